//! `sd_notify(3)` without libsystemd: under a `Type=notify` unit, systemd passes a datagram socket
//! in `$NOTIFY_SOCKET`, and a member sends `READY=1` once it serves and has joined its cluster, so
//! that `systemctl start` (and units ordered after it) wait for a member that actually works.
//! Outside systemd the variable is unset and nothing is sent.

use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::net::UnixDatagram;

/// Longest state string sent; systemd's own limit is far above it.
const STATE_BYTES_MAX: usize = 4096;

/// Sends `state` (e.g. `READY=1`) to systemd. Returns whether a socket was there to send to.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET").filter(|path| !path.is_empty()) else {
        return Ok(false);
    };
    notify_socket(&path, state)?;
    Ok(true)
}

/// Sends `state` to the socket `path` as `$NOTIFY_SOCKET` names it (`@NAME` for an abstract one).
pub fn notify_socket(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    assert!(state.len() <= STATE_BYTES_MAX, "sd_notify state too long");
    assert!(!path.is_empty(), "no socket to notify");
    let socket = UnixDatagram::unbound()?;
    let bytes = path.as_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        // An abstract socket: the name follows a NUL byte instead of the `@`.
        use std::os::linux::net::SocketAddrExt as _;
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        socket.send_to_addr(state.as_bytes(), &address)?;
    } else {
        socket.send_to(state.as_bytes(), std::path::Path::new(path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receive(receiver: &UnixDatagram) -> Vec<u8> {
        let mut buffer = [0u8; 64];
        let length = receiver.recv(&mut buffer).unwrap();
        buffer[..length].to_vec()
    }

    #[test]
    fn path_and_abstract_sockets_receive_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).unwrap();
        notify_socket(path.as_os_str(), "READY=1").unwrap();
        assert_eq!(receive(&receiver), b"READY=1");

        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("vgpu-cp-test-{}", std::process::id());
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let receiver = UnixDatagram::bind_addr(&address).unwrap();
        notify_socket(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        assert_eq!(receive(&receiver), b"STOPPING=1");
    }
}
