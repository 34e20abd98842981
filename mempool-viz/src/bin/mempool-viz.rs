//! `mempool-viz snapshot.pickle [-o timeline.svg]`: prints a per-pool summary of a memory
//! snapshot (mempool's or PyTorch's) and draws its timeline as SVG.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut input, mut output) = (None, "timeline.svg".to_string());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" | "--output" => match it.next() {
                Some(o) => output = o.clone(),
                None => return usage(),
            },
            "-h" | "--help" => return usage(),
            other if input.is_none() => input = Some(other.to_string()),
            _ => return usage(),
        }
    }
    let Some(input) = input else { return usage() };
    let view = match mempool_viz::SnapshotView::read(&input) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("mempool-viz: {input}: {e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", mempool_viz::format_summary(&view.summary()));
    println!("{} trace events", view.events.len());
    match mempool_viz::render_timeline(&view, &output) {
        Ok(()) => {
            println!("timeline written to {output}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mempool-viz: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> ExitCode {
    eprintln!("usage: mempool-viz <snapshot.pickle> [-o timeline.svg]");
    ExitCode::from(2)
}
