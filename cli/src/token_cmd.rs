//! `lakecache token`: signing keys and the tokens they sign.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use lakecache_protocol::token::{validate_scope, Claims, KeyRing, SigningKey};

use crate::units::Seconds;

#[derive(Args)]
pub struct TokenCmd {
    #[command(subcommand)]
    command: TokenCommand,
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Write a new signing-key file for workers' --auth-keys (mode 0600);
    /// with --rotate, the file's current key becomes the previous one
    Keygen(KeygenArgs),
    /// Print a token for a tenant, signed with the keys file's current key
    Create(CreateArgs),
}

#[derive(Args)]
struct KeygenArgs {
    /// Where to write the keys
    #[arg(long)]
    out: PathBuf,
    /// Keep the current key as the previous one (workers accept both)
    #[arg(long)]
    rotate: bool,
}

#[derive(Args)]
struct CreateArgs {
    /// The signing-key file (`lakecache token keygen`)
    #[arg(long, env = "LAKECACHE_AUTH_KEYS")]
    keys: PathBuf,
    /// Tenant name, shown in worker logs and metrics
    #[arg(long)]
    tenant: String,
    /// Readable scope, s3://bucket/ or s3://bucket/prefix (repeatable)
    #[arg(long)]
    allow: Vec<String>,
    /// Writable (and readable) scope (repeatable)
    #[arg(long)]
    allow_write: Vec<String>,
    /// Lifetime, e.g. 12h or 30d
    #[arg(long, default_value = "30d")]
    ttl: Seconds,
    /// A worker-to-worker token (page hand-offs)
    #[arg(long, hide = true)]
    peer: bool,
    /// The operator's token: the whole write-back backlog, and health and
    /// metrics behind --protect-metrics (no data scope unless given)
    #[arg(long)]
    operator: bool,
}

impl TokenCmd {
    pub fn run(self) -> Result<()> {
        match self.command {
            TokenCommand::Keygen(a) => keygen(&a),
            TokenCommand::Create(a) => create(&a),
        }
    }
}

fn read_keys(path: &Path) -> Result<KeyRing> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    KeyRing::parse(&text).with_context(|| format!("keys file {}", path.display()))
}

/// Writes `text` readable by the owner only, replacing `path` atomically.
pub fn write_private(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn keygen(args: &KeygenArgs) -> Result<()> {
    let previous = if args.rotate {
        Some(read_keys(&args.out)?.current().clone())
    } else {
        if args.out.exists() {
            bail!(
                "{} exists: pass --rotate to replace its current key (kept as the previous one)",
                args.out.display()
            );
        }
        None
    };
    let id = format!("k{}", crate::s3_cmd::random_token(8));
    let ring = KeyRing::new(SigningKey::generate(&id), previous);
    write_private(&args.out, &ring.to_file())?;
    eprintln!("wrote signing key {id} to {}", args.out.display());
    Ok(())
}

/// Who a token speaks for, beyond its scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Tenant,
    /// Worker to worker.
    Peer,
    /// The cluster's operator (`Claims::operator`).
    Operator,
}

/// A signed token for `tenant`.
pub fn mint(
    keys: &KeyRing,
    tenant: &str,
    read: &[String],
    write: &[String],
    ttl: Seconds,
    role: Role,
) -> Result<String> {
    if tenant.is_empty()
        || tenant.len() > 64
        || !tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        bail!("--tenant must be 1-64 characters of A-Z a-z 0-9 - _ .");
    }
    for scope in read.iter().chain(write) {
        validate_scope(scope)?;
    }
    if read.is_empty() && write.is_empty() && role == Role::Tenant {
        bail!("a token needs at least one --allow or --allow-write scope (or --operator)");
    }
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs()
        .saturating_add(ttl.0.as_secs());
    Ok(keys.current().mint(&Claims {
        tenant: tenant.to_string(),
        kid: String::new(),
        exp,
        read: read.to_vec(),
        write: write.to_vec(),
        peer: role == Role::Peer,
        operator: role == Role::Operator,
        members_key: None,
    }))
}

fn create(args: &CreateArgs) -> Result<()> {
    let keys = read_keys(&args.keys)?;
    let token = mint(
        &keys,
        &args.tenant,
        &args.allow,
        &args.allow_write,
        args.ttl,
        match (args.peer, args.operator) {
            (true, true) => bail!("a token is either --peer or --operator, not both"),
            (true, false) => Role::Peer,
            (false, true) => Role::Operator,
            (false, false) => Role::Tenant,
        },
    )?;
    println!("{token}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ttl() -> Seconds {
        Seconds(std::time::Duration::from_secs(60))
    }

    #[test]
    fn an_operator_token_needs_no_scope_and_says_what_it_is() {
        let keys = KeyRing::new(SigningKey::generate("k1"), None);
        let token = mint(&keys, "ops", &[], &[], ttl(), Role::Operator).unwrap();
        let claims = keys.verify(&token, 0).unwrap();
        assert!(claims.operator && !claims.peer);
        assert!(claims.read.is_empty() && claims.write.is_empty());
        let err = mint(&keys, "team-a", &[], &[], ttl(), Role::Tenant).unwrap_err();
        assert!(err.to_string().contains("--allow"), "{err}");
    }
}
