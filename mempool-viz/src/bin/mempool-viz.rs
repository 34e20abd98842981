//! `mempool-viz snapshot.pickle [-o timeline.svg] [--html page.html] [--from MS] [--to MS]
//! [--sites N]`: prints a per-pool summary of a memory snapshot (mempool's or PyTorch's) and
//! its top allocation sites, draws its timeline as SVG, and writes a self-contained page to
//! explore it offline.

use std::process::ExitCode;

struct Args {
    input: String,
    svg: Option<String>,
    html: Option<String>,
    from: Option<f64>,
    to: Option<f64>,
    sites: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args { input: String::new(), svg: None, html: None, from: None, to: None, sites: 5 };
    let mut it = std::env::args().skip(1);
    let ms = |v: Option<String>, what: &str| -> Result<f64, String> {
        let v = v.ok_or(format!("{what} needs a value"))?;
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(format!("{what} {v}: not a non-negative number of milliseconds")),
        }
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-o" | "--output" => a.svg = Some(it.next().ok_or("-o needs a file")?),
            "--html" => a.html = Some(it.next().ok_or("--html needs a file")?),
            "--from" => a.from = Some(ms(it.next(), "--from")?),
            "--to" => a.to = Some(ms(it.next(), "--to")?),
            "--sites" => {
                let v = it.next().ok_or("--sites needs a count")?;
                a.sites = v.parse().map_err(|_| format!("--sites {v}: not a count"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            other if a.input.is_empty() && !other.starts_with('-') => a.input = other.to_string(),
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    if a.input.is_empty() {
        return Err("no snapshot given".into());
    }
    if let (Some(f), Some(t)) = (a.from, a.to) {
        if f > t {
            return Err(format!("--from {f} is after --to {t}"));
        }
    }
    if a.svg.is_none() && a.html.is_none() {
        a.svg = Some("timeline.svg".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("mempool-viz: {e}");
            }
            eprintln!(
                "usage: mempool-viz <snapshot.pickle> [-o timeline.svg] [--html page.html] [--from MS] [--to MS] [--sites N]"
            );
            return ExitCode::from(2);
        }
    };
    let view = match mempool_viz::SnapshotView::read(&a.input) {
        Ok(v) => v,
        Err(e @ mempool_viz::Error::Io { .. }) => {
            eprintln!("mempool-viz: {}", report(&e));
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("mempool-viz: {}: {}", a.input, report(&e));
            return ExitCode::FAILURE;
        }
    };
    let by_device = view.summary_by_device();
    if by_device.len() > 1 {
        for (d, pools) in &by_device {
            println!("device {d}:");
            print!("{}", mempool_viz::format_summary(pools));
        }
    } else {
        print!("{}", mempool_viz::format_summary(&view.summary()));
    }
    println!("{} trace events", view.events.len());
    if a.sites > 0 {
        print!("{}", mempool_viz::format_sites(&view.top_sites(a.sites)));
    }
    let tl = view.timeline().window(a.from, a.to);
    if let Some(svg) = &a.svg {
        if let Err(e) = mempool_viz::render_timeline_of(&view, &tl, svg) {
            eprintln!("mempool-viz: {}", report(&e));
            return ExitCode::FAILURE;
        }
        println!("timeline written to {svg}");
    }
    if let Some(html) = &a.html {
        if let Err(e) = mempool_viz::html::write_page(&view, a.from, a.to, html) {
            eprintln!("mempool-viz: {}", report(&e));
            return ExitCode::FAILURE;
        }
        println!("page written to {html}");
    }
    ExitCode::SUCCESS
}

/// An error and its sources, as one line.
fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(x) = next {
        s.push_str(": ");
        s.push_str(&x.to_string());
        next = x.source();
    }
    s
}
