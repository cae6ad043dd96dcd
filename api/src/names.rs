//! Names of tenants and nodes: 1 to 63 characters of lowercase letters, digits, `-` and `.`,
//! starting and ending with a letter or digit (a DNS label, so names work as Kubernetes object
//! names and in file names of the agent's state directory).
//!
//! A Kubernetes claim's tenant (issue 18) is named and owned by one rule, here, used by both
//! sides: the DRA driver names the tenant it prepares ([`claim_tenant_name`]) and the control
//! plane admits a pin only for a tenant so named ([`is_claim_tenant_name`]) with the owner
//! [`claim_owner`].

pub const NAME_LENGTH_MAX: usize = 63;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("the {what} name is empty; give a name such as `infer-a`")]
    Empty { what: &'static str },
    #[error("the {what} name `{name}` is {length} characters long; the limit is {NAME_LENGTH_MAX}")]
    TooLong {
        what: &'static str,
        name: String,
        length: usize,
    },
    #[error(
        "the {what} name `{name}` has the character {character:?}; use lowercase letters, digits, `-` and `.`, starting and ending with a letter or digit"
    )]
    BadCharacter {
        what: &'static str,
        name: String,
        character: char,
    },
}

/// Checks a tenant or node name. `what` is "tenant" or "node", for the message.
pub fn validate(what: &'static str, name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { what });
    }
    let length = name.chars().count();
    if length > NAME_LENGTH_MAX {
        return Err(NameError::TooLong {
            what,
            name: name.to_owned(),
            length,
        });
    }
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    if let Some(character) = name.chars().find(|&c| !allowed(c)) {
        return Err(NameError::BadCharacter {
            what,
            name: name.to_owned(),
            character,
        });
    }
    let first = name.chars().next().expect("checked non-empty");
    let last = name.chars().last().expect("checked non-empty");
    if !alnum(first) {
        return Err(NameError::BadCharacter {
            what,
            name: name.to_owned(),
            character: first,
        });
    }
    if !alnum(last) {
        return Err(NameError::BadCharacter {
            what,
            name: name.to_owned(),
            character: last,
        });
    }
    Ok(())
}

/// Hex digits of a claim's uid in its tenant's name.
pub const CLAIM_UID_DIGITS: usize = 8;
/// What a claim's tenant's owner starts with: `k8s:<namespace>/<claim>`.
pub const CLAIM_OWNER_PREFIX: &str = "k8s:";
/// Longest Kubernetes namespace (a DNS label) and claim name (a DNS subdomain).
pub const NAMESPACE_LENGTH_MAX: usize = 63;
pub const CLAIM_NAME_LENGTH_MAX: usize = 253;
/// Longest claim owner: the prefix, a namespace, `/` and a claim name.
pub const CLAIM_OWNER_LENGTH_MAX: usize =
    CLAIM_OWNER_PREFIX.len() + NAMESPACE_LENGTH_MAX + 1 + CLAIM_NAME_LENGTH_MAX;

/// The tenant a claim named `claim_name` with uid `claim_uid` becomes: its name made a DNS
/// label, cut to leave room, then `-` and the first [`CLAIM_UID_DIGITS`] hex digits of the
/// uid, so two claims of one name (in two namespaces, or one deleted and made again) are two
/// tenants. Always a valid tenant name.
pub fn claim_tenant_name(claim_name: &str, claim_uid: &str) -> String {
    let uid: String = claim_uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .map(|c| c.to_ascii_lowercase())
        .take(CLAIM_UID_DIGITS)
        .collect();
    let room = NAME_LENGTH_MAX - CLAIM_UID_DIGITS - 1;
    let label: String = claim_name
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(room)
        .collect();
    let label = label.trim_matches('-');
    let name = match (label.is_empty(), uid.is_empty()) {
        (true, true) => "claim".to_owned(),
        (true, false) => format!("claim-{uid}"),
        (false, true) => label.to_owned(),
        (false, false) => format!("{label}-{uid}"),
    };
    assert!(
        validate("tenant", &name).is_ok(),
        "a claim's tenant name is a valid name: {name}"
    );
    name
}

/// Whether [`claim_tenant_name`] gives `tenant` for the claim named `claim_name` and some uid
/// (the control plane does not know the uid; the name still ties the tenant to its claim).
pub fn is_claim_tenant_name(claim_name: &str, tenant: &str) -> bool {
    // The uid part is what follows the last `-`, or nothing.
    let suffix = tenant.rsplit_once('-').map_or("", |(_, suffix)| suffix);
    let uid_like = suffix.len() <= CLAIM_UID_DIGITS
        && suffix
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
    [Some(""), uid_like.then_some(suffix)]
        .into_iter()
        .flatten()
        .any(|uid| claim_tenant_name(claim_name, uid) == tenant)
}

/// The owner of claim `claim` of namespace `namespace`'s tenant.
pub fn claim_owner(namespace: &str, claim: &str) -> String {
    format!("{CLAIM_OWNER_PREFIX}{namespace}/{claim}")
}

/// The namespace and claim of a claim owner (`k8s:<namespace>/<claim>`), when `owner` is one:
/// a namespace of 1 to 63 and a claim name of 1 to 253 lowercase letters, digits, `-` and `.`
/// (what Kubernetes allows, a little more loosely).
pub fn parse_claim_owner(owner: &str) -> Option<(&str, &str)> {
    let (namespace, claim) = owner.strip_prefix(CLAIM_OWNER_PREFIX)?.split_once('/')?;
    let kubernetes_name = |text: &str, length_max: usize| {
        (1..=length_max).contains(&text.len())
            && text
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
    };
    (kubernetes_name(namespace, NAMESPACE_LENGTH_MAX)
        && kubernetes_name(claim, CLAIM_NAME_LENGTH_MAX))
    .then_some((namespace, claim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_dns_labels() {
        for name in ["a", "infer-a", "node-01", "x.y", &"a".repeat(63)] {
            assert_eq!(validate("tenant", name), Ok(()), "{name}");
        }
    }

    #[test]
    fn rejects_odd_names_with_a_reason() {
        assert!(matches!(
            validate("tenant", ""),
            Err(NameError::Empty { .. })
        ));
        assert!(matches!(
            validate("tenant", &"a".repeat(64)),
            Err(NameError::TooLong { .. })
        ));
        for name in ["Infer", "a b", "-a", "a-", "a/b", "ü", "a\0"] {
            let error = validate("tenant", name).unwrap_err();
            assert!(
                matches!(error, NameError::BadCharacter { .. }),
                "{name}: {error}"
            );
        }
    }

    #[test]
    fn a_claims_tenant_is_recognised_by_its_claims_name() {
        let uid = "3F2A9C1E-0000-4000-8000-000000000000";
        assert_eq!(claim_tenant_name("train", uid), "train-3f2a9c1e");
        assert_eq!(
            claim_tenant_name("Pod_0.gpu-claim", uid),
            "pod-0-gpu-claim-3f2a9c1e"
        );
        assert_eq!(claim_tenant_name("", ""), "claim");
        let long = "x".repeat(253);
        for (claim, uid) in [
            ("train", uid),
            ("", uid),
            ("train", ""),
            ("", ""),
            (&long[..], uid),
        ] {
            let tenant = claim_tenant_name(claim, uid);
            assert!(is_claim_tenant_name(claim, &tenant), "{claim} {tenant}");
        }
        assert!(!is_claim_tenant_name("train", "infer-3f2a9c1e"));
        assert!(!is_claim_tenant_name("train", "train-3f2a9c1e0"));
        assert!(!is_claim_tenant_name("train", "train-xyz"));
        assert!(!is_claim_tenant_name("train-a", "train-3f2a9c1e"));
    }

    #[test]
    fn claim_owners_round_trip_and_odd_ones_are_not_claims() {
        let owner = claim_owner("ml", "train");
        assert_eq!(owner, "k8s:ml/train");
        assert_eq!(parse_claim_owner(&owner), Some(("ml", "train")));
        let longest = claim_owner(&"n".repeat(63), &"c".repeat(253));
        assert_eq!(longest.len(), CLAIM_OWNER_LENGTH_MAX);
        assert!(parse_claim_owner(&longest).is_some());
        for odd in [
            "ml/train",
            "k8s:ml",
            "k8s:/train",
            "k8s:ml/",
            "k8s:ML/train",
            "k8s:ml/a/b",
            &claim_owner(&"n".repeat(64), "c"),
            &claim_owner("n", &"c".repeat(254)),
        ] {
            assert_eq!(parse_claim_owner(odd), None, "{odd}");
        }
    }
}
