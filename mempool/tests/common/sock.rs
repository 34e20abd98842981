//! A raw `sendmsg` with `SCM_RIGHTS`, for the IPC tests' hostile (and honest) senders, and a
//! pipe whose write end tells whether every copy of it was closed (no descriptor leaked).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// A hostile (or honest) sender: `data` with `fds` attached (SCM_RIGHTS), one `sendmsg`.
pub(crate) fn sendmsg_raw(sock: &UnixStream, data: &[u8], fds: &[RawFd]) -> isize {
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: pure arithmetic on a length.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: a plain C struct; all zeros is an empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has room for one header and `fds`, written inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), fd_bytes);
        }
    }
    // SAFETY: `msg` points at live buffers for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    assert!(n >= 0, "sendmsg: {}", std::io::Error::last_os_error());
    n
}

/// A pipe: (read end, non-blocking; write end). Every copy of the write end that is sent and
/// then leaked keeps the read end from seeing end-of-file.
pub(crate) fn pipe() -> (OwnedFd, OwnedFd) {
    let mut p = [0; 2];
    // SAFETY: `p` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
    // SAFETY: the two descriptors `pipe2` just opened, owned here alone.
    unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
}

/// Whether every copy of the pipe's write end is closed (the read end sees end-of-file).
pub(crate) fn all_writers_closed(read: &OwnedFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: reads at most one byte into `b`.
    let n = unsafe { libc::read(read.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
    n == 0
}
