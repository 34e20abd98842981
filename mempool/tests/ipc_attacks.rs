//! Hostile-review probes (issue 14) for `mempool::ipc` that run without a GPU: hostile bytes for
//! `IpcHandle::from_bytes`, hostile senders for `ipc::receive_handle` (raw `sendmsg` with
//! `SCM_RIGHTS`). Probes named `held_*` checked what held at review time; the others were
//! findings, fixed. (Two compile-time findings, `Exported<bool>` and replacing the exported
//! buffer through `buffer_mut`, no longer compile: `Exported<T: AnyBitPattern>`, no
//! `buffer_mut`.)

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use mempool::ipc::{self, IpcHandle};

mod common;
use common::sock::{all_writers_closed, pipe, sendmsg_raw};

const MAGIC: [u8; 8] = *b"MPIPC\x00\x00\x02";
/// The fixed part of `IpcHandle::to_bytes`.
const FIXED: usize = 229;

/// The bytes of a handle: kind `via` (1 legacy, 2 pool, 3 mapped), `maps` physical allocations.
fn handle_bytes(via: u8, export: u64, offset: u64, bytes: u64, maps: &[u64]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&MAGIC);
    v.push(via);
    v.extend_from_slice(&[0u8; 16]); // boot id
    v.extend_from_slice(&[0u8; 16]); // device uuid
    v.extend_from_slice(&1u32.to_le_bytes()); // pid
    v.extend_from_slice(&export.to_le_bytes()); // the token's first half
    v.extend_from_slice(&[0u8; 8]);
    v.extend_from_slice(&[0u8; 16]); // the pool key
    v.extend_from_slice(&[7u8; 64]);
    v.extend_from_slice(&[9u8; 64]);
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&bytes.to_le_bytes());
    v.extend_from_slice(&4u32.to_le_bytes());
    v.extend_from_slice(&(maps.len() as u32).to_le_bytes());
    for m in maps {
        v.extend_from_slice(&m.to_le_bytes());
    }
    assert_eq!(v.len(), FIXED + 8 * maps.len());
    v
}

/// One message as `ipc::send` frames it: a u32 length, then the handle's bytes.
fn framed(handle: &[u8]) -> Vec<u8> {
    let mut m = (handle.len() as u32).to_le_bytes().to_vec();
    m.extend_from_slice(handle);
    m
}

fn dups(fd: &OwnedFd, n: usize) -> Vec<OwnedFd> {
    (0..n).map(|_| fd.try_clone().unwrap()).collect()
}

// ---------------------------------------------------------------------------------------------
// Findings.

/// FINDING: two handles sent back to back without descriptors (two `ipc::send` of legacy
/// exports, exactly the bytes `send` writes) are glued by the kernel into one `recvmsg`
/// (a Unix stream socket merges segments that carry no SCM_RIGHTS): the first
/// `receive_handle` fails with "more bytes than one handle" and both handles are lost.
#[test]
fn probe_two_legacy_sends_back_to_back_both_arrive() {
    let (tx, rx) = UnixStream::pair().unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let h1 = handle_bytes(1, 1, 0, 4096, &[]);
    let h2 = handle_bytes(1, 2, 512, 4096, &[]);
    sendmsg_raw(&tx, &framed(&h1), &[]);
    sendmsg_raw(&tx, &framed(&h2), &[]);
    let r1 = ipc::receive_handle(&rx).map(|(h, fds)| (h, fds.len()));
    let r2 = ipc::receive_handle(&rx).map(|(h, fds)| (h, fds.len()));
    let want1 = IpcHandle::from_bytes(&h1).unwrap();
    let want2 = IpcHandle::from_bytes(&h2).unwrap();
    assert!(
        matches!(&r1, Ok((h, 0)) if *h == want1) && matches!(&r2, Ok((h, 0)) if *h == want2),
        "first: {r1:?}\nsecond: {r2:?}"
    );
}

/// FINDING: a legacy handle (no descriptors) followed by a pool handle (one descriptor): the
/// first `recvmsg` reads both, the pool handle's descriptor with them; the first receive fails,
/// the second blocks (here: times out) because its message was eaten.
#[test]
fn probe_legacy_then_pool_handle_both_arrive() {
    let (tx, rx) = UnixStream::pair().unwrap();
    rx.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let (r, w) = pipe();
    let h1 = handle_bytes(1, 1, 0, 4096, &[]);
    let h2 = handle_bytes(2, 2, 0, 4096, &[]);
    sendmsg_raw(&tx, &framed(&h1), &[]);
    sendmsg_raw(&tx, &framed(&h2), &[w.as_raw_fd()]);
    drop(w);
    let r1 = ipc::receive_handle(&rx).map(|(h, fds)| (h.num_fds(), fds.len()));
    let r2 = ipc::receive_handle(&rx).map(|(h, fds)| (h.num_fds(), fds.len()));
    assert!(all_writers_closed(&r), "a descriptor leaked");
    assert!(matches!(r1, Ok((0, 0))) && matches!(r2, Ok((1, 1))), "first: {r1:?}\nsecond: {r2:?}");
}

/// FINDING: a signal (handler without SA_RESTART) delivered while `receive_handle` waits for
/// the rest of the 4-byte length prefix: the `read` loop returns `Interrupted` as an error (the
/// `recvmsg` loop and `read_exact` retry EINTR, this loop does not), and the partly read
/// message is left half-consumed on the socket.
#[test]
fn probe_eintr_while_reading_the_length_prefix_is_retried() {
    extern "C" fn on_usr1(_: libc::c_int) {}
    // SAFETY: installs a handler that does nothing (async-signal-safe) for SIGUSR1.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = 0; // no SA_RESTART
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    let (tx, rx) = UnixStream::pair().unwrap();
    let h = handle_bytes(1, 1, 0, 4096, &[]);
    let msg = framed(&h);
    (&tx).write_all(&msg[..2]).unwrap();
    let t = std::thread::spawn(move || ipc::receive_handle(&rx).map(|(h, _)| h));
    std::thread::sleep(Duration::from_millis(300)); // recvmsg returned 2 bytes; now in `read`
    use std::os::unix::thread::JoinHandleExt;
    // SAFETY: signals a thread of this process that is still running (joined below).
    unsafe { libc::pthread_kill(t.as_pthread_t(), libc::SIGUSR1) };
    std::thread::sleep(Duration::from_millis(100));
    let _ = (&tx).write_all(&msg[2..]); // the receiver may have given up already
    let r = t.join().unwrap();
    assert!(matches!(&r, Ok(got) if *got == IpcHandle::from_bytes(&h).unwrap()), "{r:?}");
}

// ---------------------------------------------------------------------------------------------
// What held.

/// `from_bytes` on hostile bytes: truncations, every single-byte corruption of valid handles
/// of all three kinds, random bytes, and extreme counts: errors, never a panic.
#[test]
fn held_from_bytes_never_panics() {
    let mut seeds = vec![
        handle_bytes(1, 1, 0, 4096, &[]),
        handle_bytes(2, 1, 0, 4096, &[]),
        handle_bytes(3, 1, 0, 4096, &[2 << 20, 2 << 20]),
        handle_bytes(3, 1, u64::MAX, u64::MAX, &[u64::MAX; 64]),
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for len in 0..FIXED + 8 * 70 {
        seeds.push((0..len).map(|_| rnd() as u8).collect());
    }
    for base in &seeds {
        for cut in 0..=base.len() {
            let _ = IpcHandle::from_bytes(&base[..cut]);
        }
        for i in 0..base.len() {
            for v in [0u8, 1, 2, 3, 4, 0x40, 0x41, 0x7f, 0xff] {
                let mut b = base.clone();
                b[i] = v;
                if let Ok(h) = IpcHandle::from_bytes(&b) {
                    assert_eq!(IpcHandle::from_bytes(&h.to_bytes()).unwrap(), h, "round trip");
                    let _ = (h.num_fds(), h.num_bytes(), h.offset(), h.pid(), format!("{h:?}"));
                }
            }
        }
    }
    // A count of u32::MAX, and 65 allocations.
    let mut b = handle_bytes(3, 1, 0, 0, &[1]);
    b[FIXED - 4..FIXED].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(IpcHandle::from_bytes(&b).is_err());
    assert!(IpcHandle::from_bytes(&handle_bytes(3, 1, 0, 0, &[1; 65])).is_err());
    // Legacy / pool with allocations, mapped without: refused.
    assert!(IpcHandle::from_bytes(&handle_bytes(1, 1, 0, 0, &[1])).is_err());
    assert!(IpcHandle::from_bytes(&handle_bytes(3, 1, 0, 0, &[])).is_err());
    // The accessors of a hostile but well-formed handle.
    let h = IpcHandle::from_bytes(&handle_bytes(3, 1, u64::MAX, u64::MAX, &[u64::MAX; 64])).unwrap();
    assert_eq!((h.num_fds(), h.offset()), (64, u64::MAX));
}

/// More than `MAX_FDS` descriptors: refused ("cut short"), and none leaks (the kernel closes
/// those that did not fit, `receive_handle` those that did).
#[test]
fn held_too_many_fds_are_refused_and_closed() {
    let (tx, rx) = UnixStream::pair().unwrap();
    let (r, w) = pipe();
    let copies = dups(&w, ipc::MAX_FDS + 6);
    drop(w);
    let raw: Vec<RawFd> = copies.iter().map(|f| f.as_raw_fd()).collect();
    sendmsg_raw(&tx, &framed(&handle_bytes(1, 1, 0, 4096, &[])), &raw);
    drop(copies);
    let e = ipc::receive_handle(&rx).unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
    assert!(all_writers_closed(&r), "a received descriptor leaked");
}

/// A hostile length prefix, a message that is not a handle, and a peer that closes mid-message,
/// each with descriptors attached: errors, descriptors closed, no hang.
#[test]
fn held_hostile_frames_close_their_fds() {
    let cases: Vec<(Vec<u8>, bool)> = vec![
        (u32::MAX.to_le_bytes().to_vec(), false), // absurd length
        (framed(&[0xAB; 300]), false),            // not a handle
        ((300u32).to_le_bytes().iter().chain(&[0u8; 10]).copied().collect(), true), // then close
        (vec![1, 0], true),                       // half a prefix, then close
    ];
    for (data, close) in cases {
        let (tx, rx) = UnixStream::pair().unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let (r, w) = pipe();
        let copies = dups(&w, 3);
        drop(w);
        let raw: Vec<RawFd> = copies.iter().map(|f| f.as_raw_fd()).collect();
        sendmsg_raw(&tx, &data, &raw);
        drop(copies);
        if close {
            drop(tx);
        } else {
            std::mem::forget(tx); // keep the peer open: the error must not need EOF
        }
        let e = ipc::receive_handle(&rx).unwrap_err();
        assert!(all_writers_closed(&r), "descriptors leaked on: {e}");
    }
}

/// Descriptors a handle does not need come back owned (closed when dropped); descriptors a
/// hostile sender attaches to a later chunk of the message are an error (as documented), and
/// closed: no leak either way.
#[test]
fn held_extra_or_late_fds_do_not_leak() {
    let (tx, rx) = UnixStream::pair().unwrap();
    let (r, w) = pipe();
    let copies = dups(&w, 5);
    drop(w);
    let raw: Vec<RawFd> = copies.iter().map(|f| f.as_raw_fd()).collect();
    sendmsg_raw(&tx, &framed(&handle_bytes(1, 1, 0, 4096, &[])), &raw);
    drop(copies);
    let (h, fds) = ipc::receive_handle(&rx).unwrap();
    assert_eq!((h.num_fds(), fds.len()), (0, 5));
    drop(fds);
    assert!(all_writers_closed(&r));

    let (r, w) = pipe();
    let msg = framed(&handle_bytes(2, 1, 0, 4096, &[]));
    sendmsg_raw(&tx, &msg[..4], &[]);
    let t = std::thread::spawn(move || ipc::receive_handle(&rx).map(|(h, f)| (h.num_fds(), f.len())));
    std::thread::sleep(Duration::from_millis(200));
    sendmsg_raw(&tx, &msg[4..], &[w.as_raw_fd()]);
    drop(w);
    let e = t.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("came after the message's first bytes"), "{e}");
    assert!(all_writers_closed(&r));
}
