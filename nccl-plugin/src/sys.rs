//! Socket calls std does not offer: sending a file descriptor with a message (SCM_RIGHTS),
//! receiving descriptors, and non-blocking sends/receives into raw buffers that NCCL owns; and
//! the shared mappings of the node-local tables and completion rings.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A read-write `MAP_SHARED` mapping of the first `bytes` bytes of `fd` (which must be at
/// least that long); page-aligned. Undo with [`unmap`].
pub fn map_shared(fd: RawFd, bytes: usize) -> io::Result<std::ptr::NonNull<libc::c_void>> {
    // SAFETY: a fresh shared mapping; the kernel picks the address and failure is MAP_FAILED,
    // checked below. It touches no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(std::ptr::NonNull::new(p).expect("mmap never returns NULL here"))
}

/// Unmaps what [`map_shared`] mapped.
///
/// # Safety
/// `p` and `bytes` are exactly a `map_shared` result and its length, and no reference into the
/// mapping outlives this call.
pub unsafe fn unmap(p: *mut libc::c_void, bytes: usize) {
    // SAFETY: as the caller promises.
    let result = unsafe { libc::munmap(p, bytes) };
    debug_assert_eq!(result, 0, "munmap of our own mapping failed");
}

/// Non-blocking send of `buf`, optionally passing `fd` along. Returns bytes sent (0 on EAGAIN).
pub fn send(sock: RawFd, buf: &[u8], fd: Option<RawFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut _,
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cmsg_buf = [0u64; 4];
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        msg.msg_control = cmsg_buf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `space` bytes (32 available), enough for one cmsg
        // holding one int; CMSG_FIRSTHDR/CMSG_DATA stay inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    // SAFETY: `msg` is fully initialised and its buffers are live.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

/// Non-blocking send from raw memory (a host buffer NCCL registered with us).
///
/// # Safety
/// `ptr..ptr+len` must be readable for the duration of the call.
pub unsafe fn send_raw(sock: RawFd, ptr: *const u8, len: usize) -> io::Result<usize> {
    // SAFETY: the caller guarantees the range is readable.
    let n = unsafe {
        libc::send(
            sock,
            ptr.cast(),
            len,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

/// Non-blocking receive into raw memory. `Ok(None)` on EAGAIN, `Ok(Some(0))` on EOF.
///
/// # Safety
/// `ptr..ptr+len` must be writable and not aliased for the duration of the call.
pub unsafe fn recv_raw(sock: RawFd, ptr: *mut u8, len: usize) -> io::Result<Option<usize>> {
    // SAFETY: the caller guarantees the range is writable.
    let n = unsafe { libc::recv(sock, ptr.cast(), len, libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(n as usize))
}

/// Non-blocking receive into `buf`, collecting any descriptors passed with the bytes.
/// `Ok(None)` on EAGAIN, `Ok(Some(0))` on EOF.
pub fn recv_with_fds(
    sock: &impl AsRawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<Option<usize>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cmsg_buf = [0u64; 32];
    // SAFETY: an all-zero msghdr is valid; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg_buf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg_buf);
    // SAFETY: `msg` points at live buffers of the sizes given.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        };
    }
    // SAFETY: walking the control messages the kernel wrote into `cmsg_buf`, within
    // msg_controllen; each SCM_RIGHTS payload is an array of ints we now own.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count =
                    ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Some(n as usize))
}

/// The first non-loopback IPv4 address of this host, if any.
pub fn first_ipv4() -> Option<std::net::Ipv4Addr> {
    let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below; we only read it in between.
    unsafe {
        if libc::getifaddrs(&mut ifs) != 0 {
            return None;
        }
        let mut found = None;
        let mut p = ifs;
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() && (*a).sa_family as i32 == libc::AF_INET {
                let sin = &*(a as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() && found.is_none() {
                    found = Some(ip);
                }
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(ifs);
        found
    }
}

/// A raw pointer that may cross to a worker thread.
#[derive(Clone, Copy, Debug)]
pub struct SendPtr(pub u64);
// SAFETY: the pointee is memory NCCL keeps valid until `test` reports the request done; only
// one worker touches each byte range.
unsafe impl Send for SendPtr {}

/// Takes an exclusive `flock` on `file` without waiting: `Ok(false)` if another open file
/// description holds it.
pub fn try_lock(file: &std::fs::File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor `file` owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(e)
    }
}

/// The process's user id.
pub fn uid() -> u32 {
    // SAFETY: getuid has no failure mode and touches no memory of ours.
    unsafe { libc::getuid() }
}
