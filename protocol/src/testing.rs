//! Helpers the project's tests share across crates.

/// Generated cases for a fuzz test: a tenth of `full` in the test
/// command; all of them (over 1,000,000 across the project) with
/// `LAKECACHE_FUZZ=full`.
pub fn fuzz_cases(full: u32) -> u32 {
    match std::env::var("LAKECACHE_FUZZ").as_deref() {
        Ok("full") => full,
        _ => full / 10,
    }
}

/// A throwaway PKI for TLS tests, made with the `openssl` command: a CA,
/// a certificate for 127.0.0.1/localhost usable by servers and clients,
/// and a second, unrelated CA.
pub struct TestPki {
    pub ca: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub other_ca: std::path::PathBuf,
}

impl TestPki {
    pub fn create(dir: &std::path::Path) -> std::io::Result<Self> {
        let openssl = |args: &[&str]| -> std::io::Result<()> {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()?;
            if out.status.success() {
                Ok(())
            } else {
                Err(std::io::Error::other(format!(
                    "openssl {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )))
            }
        };
        let ca = |name: &str| {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.pem"),
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ])
        };
        ca("test-ca")?;
        ca("other-ca")?;
        std::fs::write(
            dir.join("leaf.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n",
        )?;
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "leaf.key",
            "-out",
            "leaf.csr",
            "-subj",
            "/CN=localhost",
        ])?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "test-ca.pem",
            "-CAkey",
            "test-ca.key",
            "-CAcreateserial",
            "-out",
            "leaf.pem",
            "-days",
            "2",
            "-extfile",
            "leaf.ext",
        ])?;
        Ok(Self {
            ca: dir.join("test-ca.pem"),
            cert: dir.join("leaf.pem"),
            key: dir.join("leaf.key"),
            other_ca: dir.join("other-ca.pem"),
        })
    }
}
