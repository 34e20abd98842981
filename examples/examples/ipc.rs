//! Buffers shared between processes (CUDA IPC, `mempool::ipc`): a producer fills two buffers of
//! its caching allocator (the second at a non-zero offset inside its segment) and exports them;
//! a consumer process on GPU 0 and one on GPU 1 (when there is one) open them, check the
//! producer's values and write their own; the producer checks each consumer's writes. The
//! producer launches the consumers itself (this same program with `--consume <gpu> <handles>`).
//!
//! ```sh
//! cargo run --release --example ipc
//! cargo run --release --example ipc -- --len 4194304     # elements per buffer (default 1 Mi)
//! ```

use std::process::ExitCode;

use cudarc::driver::CudaContext;
use mempool::ipc::{self, Exported, IpcHandle};
use mempool::Allocator;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Res<Vec<u8>> {
    if s.len() & 1 == 1 {
        return Err("odd hex string".into());
    }
    (0..s.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?)).collect()
}

/// What buffer `k` holds after `round` consumers added one each.
fn value(k: usize, i: usize, round: usize) -> f32 {
    (k * 1000 + i % 1000) as f32 + round as f32
}

/// A consumer: opens every handle on a stream of `gpu`, checks the values of `round`, writes
/// those of `round + 1`.
fn consume(gpu: usize, round: usize, handles: &str) -> Res<()> {
    let ctx = CudaContext::new(gpu)?;
    let stream = ctx.new_stream()?;
    for (k, h) in handles.split(',').enumerate() {
        let handle = IpcHandle::from_bytes(&unhex(h)?)?;
        let mut view = ipc::import::<f32>(&handle, &stream)?; // waits for the producer's writes
        let got = stream.clone_dtoh(&view)?;
        if let Some(i) = (0..got.len()).find(|&i| got[i] != value(k, i, round)) {
            return Err(format!("GPU {gpu}: buffer {k}[{i}] = {}, expected {}", got[i], value(k, i, round)).into());
        }
        let next: Vec<f32> = (0..got.len()).map(|i| value(k, i, round + 1)).collect();
        stream.memcpy_htod(&next, &mut view)?;
        println!(
            "  consumer pid {} on GPU {gpu}: buffer {k} ({} bytes at offset {} of its segment, from pid {}) checked and written",
            std::process::id(),
            handle.num_bytes(),
            handle.offset(),
            handle.pid()
        );
    } // each view waits for its stream, closes its mapping and gives its lease back
    Ok(())
}

fn produce(len: usize) -> Res<()> {
    let gpus = mempool::device_count()?;
    let alloc = Allocator::cuda(0)?;
    let stream = alloc.current_stream();
    let _first = alloc.alloc::<u8>(512)?; // so that the next buffer lies inside the segment
    let mut exported = Vec::new();
    for k in 0..2 {
        let mut b = alloc.alloc::<f32>(len)?;
        let host: Vec<f32> = (0..len).map(|i| value(k, i, 0)).collect();
        stream.memcpy_htod(&host, &mut b)?;
        exported.push(Exported::new(b)?);
    }
    let handles: Vec<String> =
        exported.iter().map(|e| Ok(hex(&e.handle()?.to_bytes()))).collect::<Res<Vec<String>>>()?;
    println!("producer pid {} on GPU 0: 2 buffers of {len} f32 exported", std::process::id());
    let exe = std::env::current_exe()?;
    for (round, gpu) in (0..gpus.min(2)).enumerate() {
        let status = std::process::Command::new(&exe)
            .args(["--consume", &gpu.to_string(), &round.to_string(), &handles.join(",")])
            .status()?;
        if !status.success() {
            return Err(format!("the consumer on GPU {gpu} failed ({status})").into());
        }
        for (k, e) in exported.iter().enumerate() {
            let got = stream.clone_dtoh(e.buffer())?;
            if let Some(i) = (0..len).find(|&i| got[i] != value(k, i, round + 1)) {
                return Err(format!("buffer {k}[{i}] = {} after GPU {gpu}'s consumer", got[i]).into());
            }
        }
        println!("producer: GPU {gpu}'s writes to both buffers checked");
    }
    drop(exported);
    println!("producer: exports closed ({} waiting for a lease)", ipc::reclaim());
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["--consume", gpu, round, handles] => match (gpu.parse(), round.parse()) {
            (Ok(g), Ok(r)) => consume(g, r, handles),
            _ => Err("--consume <gpu> <round> <handles>".into()),
        },
        [] => produce(1 << 20),
        ["--len", n] => n.parse().map_err(|_| "--len needs a number".into()).and_then(produce),
        _ => Err("usage: ipc [--len N]".into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipc: {e}");
            ExitCode::FAILURE
        }
    }
}
