//! Unix users for tenants: the tenant `T`'s processes run as the local user `vgpu-T` when the
//! node has one (looked up through NSS with `getpwnam_r`, so LDAP and sssd users count), else as
//! the agent's own user. The lookups are the only `unsafe` of the agent outside NVML and CUDA.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};

/// The prefix of a tenant's Unix user name.
pub const USER_PREFIX: &str = "vgpu-";

/// A Unix identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// The agent's own effective identity.
pub fn current() -> Identity {
    // SAFETY: geteuid and getegid cannot fail and touch no memory of ours.
    unsafe {
        Identity {
            uid: libc::geteuid(),
            gid: libc::getegid(),
        }
    }
}

/// The user `name`'s uid and primary gid, if the node knows it.
pub fn lookup(name: &str) -> Option<Identity> {
    let name = CString::new(name).ok()?;
    let mut buffer = vec![0u8; 16 * 1024];
    // SAFETY: an all-zero passwd is a valid value for getpwnam_r to overwrite.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: `name` is NUL-terminated, `entry` and `found`
    // are out-parameters, and `buffer` is writable for its length; the strings the entry points
    // to live in `buffer`, which outlives their use below (none: we copy the two numbers).
    let status = unsafe {
        libc::getpwnam_r(
            name.as_ptr(),
            &mut entry,
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            &mut found,
        )
    };
    if status != 0 || found.is_null() {
        return None;
    }
    Some(Identity {
        uid: entry.pw_uid,
        gid: entry.pw_gid,
    })
}

/// The user name of `uid`, for messages.
pub fn name_of(uid: u32) -> Option<String> {
    let mut buffer = vec![0u8; 16 * 1024];
    // SAFETY: as in `lookup`.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: as in `lookup`; `pw_name` points into `buffer` and is read before it is dropped.
    let status = unsafe {
        libc::getpwuid_r(
            uid,
            &mut entry,
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            &mut found,
        )
    };
    if status != 0 || found.is_null() || entry.pw_name.is_null() {
        return None;
    }
    // SAFETY: getpwuid_r filled `pw_name` with a NUL-terminated string inside `buffer`.
    let name = unsafe { CStr::from_ptr(entry.pw_name) };
    Some(name.to_string_lossy().into_owned())
}

/// Who runs tenant `tenant`'s processes on this node: `vgpu-<tenant>` when it exists, else
/// `fallback` (the agent's own identity).
pub fn tenant_identity(tenant: &str, fallback: Identity) -> Identity {
    lookup(&format!("{USER_PREFIX}{tenant}")).unwrap_or(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_found_and_a_missing_user_is_not() {
        assert_eq!(lookup("root"), Some(Identity { uid: 0, gid: 0 }));
        assert_eq!(name_of(0).as_deref(), Some("root"));
        assert_eq!(lookup("vgpu-no-such-tenant-here"), None);
        assert_eq!(lookup("bad\0name"), None);
        let me = current();
        assert_eq!(tenant_identity("no-such-tenant-here", me), me);
    }
}
