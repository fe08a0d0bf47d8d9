//! Generated inputs against the parsers every request goes through: object
//! URIs and API paths, and tokens. No input panics; every rejection is a
//! typed error; accepted values round-trip.

use lakecache_protocol::testing::fuzz_cases;
use lakecache_protocol::token::{Claims, KeyRing, SigningKey, TokenError};
use lakecache_protocol::ObjectUri;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases(200_000)))]

    #[test]
    fn object_uris_parse_or_are_rejected_and_round_trip(
        raw in prop_oneof![
            "s3://[a-z0-9.\\-]{0,12}/[\\PC/%.]{0,40}",
            "\\PC{0,60}",
        ]
    ) {
        if let Ok(uri) = raw.parse::<ObjectUri>() {
            let again: ObjectUri = uri.to_string().parse().unwrap();
            prop_assert_eq!(&again, &uri);
            let path = uri.api_path("objects");
            let rest = path.strip_prefix("/v1/objects/").unwrap();
            prop_assert_eq!(ObjectUri::from_api_path(rest).unwrap(), uri);
        }
    }

    #[test]
    fn api_paths_parse_or_are_rejected(rest in "[\\PC%/.]{0,60}") {
        if let Ok(uri) = ObjectUri::from_api_path(&rest) {
            let path = uri.api_path("objects");
            let back = ObjectUri::from_api_path(path.strip_prefix("/v1/objects/").unwrap());
            prop_assert_eq!(back.unwrap(), uri);
        }
    }
}

fn ring() -> (SigningKey, KeyRing) {
    let key = SigningKey::generate("k1");
    (key.clone(), KeyRing::new(key, None))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases(250_000)))]

    #[test]
    fn arbitrary_bearer_values_never_verify(raw in prop_oneof![
        "lct1\\.[A-Za-z0-9_\\-]{0,80}\\.[A-Za-z0-9_\\-]{0,50}",
        "\\PC{0,120}",
    ]) {
        let (_, ring) = ring();
        prop_assert!(ring.verify(&raw, 0).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases(100_000)))]

    /// One changed character anywhere in a valid token is refused.
    #[test]
    fn a_changed_character_breaks_the_token(at in any::<prop::sample::Index>(), to in "[A-Za-z0-9_.\\-]") {
        let (key, ring) = ring();
        let token = key.mint(&Claims {
            tenant: "t".into(),
            kid: String::new(),
            exp: u64::MAX,
            read: vec!["s3://data/".into()],
            write: vec![],
            peer: false,
            operator: false,
            members_key: None,
        });
        let i = at.index(token.len());
        let mut bytes = token.clone().into_bytes();
        bytes[i] = to.as_bytes()[0];
        let changed = String::from_utf8(bytes).unwrap();
        let verdict = ring.verify(&changed, 0);
        if changed == token {
            prop_assert!(verdict.is_ok());
        } else {
            // Base64 of the same bytes may differ only in unused low bits
            // of the last character; anything that still decodes to the
            // signed bytes is the same token.
            let same = verdict.as_ref().is_ok_and(|c| c.tenant == "t");
            prop_assert!(
                same || matches!(
                    verdict,
                    Err(TokenError::Malformed | TokenError::BadSignature | TokenError::UnknownKey(_))
                ),
                "{changed:?} -> {verdict:?}"
            );
        }
    }
}
