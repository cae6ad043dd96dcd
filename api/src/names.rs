//! Names of tenants and nodes: 1 to 63 characters of lowercase letters, digits, `-` and `.`,
//! starting and ending with a letter or digit (a DNS label, so names work as Kubernetes object
//! names and in file names of the agent's state directory).

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
}
