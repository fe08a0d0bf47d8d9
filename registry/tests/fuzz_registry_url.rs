//! Generated `--registry` values: parsed or rejected with a message, never
//! a panic; accepted ones name at least one endpoint.

use lakecache_protocol::testing::fuzz_cases;
use lakecache_registry::RegistryUrl;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases(150_000)))]

    #[test]
    fn registry_urls_parse_or_are_rejected(raw in prop_oneof![
        "(static:|file:|etcd://)[a-z0-9.:,/\\-]{0,40}",
        "\\PC{0,50}",
    ]) {
        match raw.parse::<RegistryUrl>() {
            Ok(RegistryUrl::Static(addrs)) => prop_assert!(!addrs.is_empty()),
            Ok(RegistryUrl::Etcd { endpoints, prefix, .. }) => {
                prop_assert!(!endpoints.is_empty());
                prop_assert!(prefix.starts_with('/'));
            }
            Ok(RegistryUrl::File(path)) => prop_assert!(!path.as_os_str().is_empty()),
            Err(message) => prop_assert!(!message.is_empty()),
        }
    }
}
