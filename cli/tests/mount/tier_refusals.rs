//! `--local-cache` pointed where it must not go: each refusal names the
//! path and the fix, mounts nothing, and deletes nothing.

use super::local_tier::mount_with_tier;
use super::*;

/// Runs the mount command with `flags`; it must fail saying `expected`.
fn refused(env: &Env, flags: &[&std::ffi::OsStr], expected: &str) {
    let out = env.mount_command().args(flags).output_bounded().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains(expected),
        "{flags:?}: wanted an error containing {expected:?}, got {}\n{stderr}",
        out.status
    );
}

#[test]
fn a_local_cache_in_use_foreign_misplaced_or_oversized_is_refused_with_the_fix() {
    let mut env = Env::start(1);
    let tier = mount_with_tier(&mut env, &[]);
    let os = |s: &str| std::ffi::OsString::from(s);
    // A second mount on the same tier directory.
    refused(
        &env,
        &[&os("--local-cache"), tier.as_os_str()],
        "is in use by another lakecache mount (pid",
    );
    env.mount.take().unwrap().term();
    wait_mounted(&env.mountpoint(), false);

    // A directory holding someone's files keeps them.
    let home = env.dir.path().join("home");
    fs::create_dir(&home).unwrap();
    fs::write(home.join("thesis.tex"), "years of work").unwrap();
    refused(
        &env,
        &[&os("--local-cache"), home.as_os_str()],
        "pick an empty or new directory",
    );
    assert_eq!(
        fs::read_to_string(home.join("thesis.tex")).unwrap(),
        "years of work"
    );
    // A disk that is not mounted: the parent is missing.
    let unmounted = env.dir.path().join("nvme0/lakecache");
    refused(
        &env,
        &[&os("--local-cache"), unmounted.as_os_str()],
        "its parent directory does not exist",
    );
    // Larger than the filesystem, smaller than the minimum.
    for (size, expected) in [
        ("1000000TiB", "is larger than the filesystem"),
        ("1MiB", "--local-cache-size must be at least"),
    ] {
        refused(
            &env,
            &[
                &os("--local-cache"),
                tier.as_os_str(),
                &os("--local-cache-size"),
                &os(size),
            ],
            expected,
        );
    }
    // A whole-object policy with no tier, or outside the mount.
    refused(
        &env,
        &[&os("--local-cache-whole"), &os("shards/")],
        "--local-cache-whole needs a node-local tier: add --local-cache DIR",
    );
    refused(
        &env,
        &[
            &os("--local-cache"),
            tier.as_os_str(),
            &os("--local-cache-whole"),
            &os("../elsewhere"),
        ],
        "must name a directory inside the mount, like shards/",
    );
    // A tier written by a newer lakecache.
    fs::write(tier.join("FORMAT"), "lakecache-local-tier-v9\n").unwrap();
    refused(
        &env,
        &[&os("--local-cache"), tier.as_os_str()],
        "holds a tier of format \"lakecache-local-tier-v9\"",
    );
}
