//! The offline page (`mempool-viz --html`): self-contained, and, in a real headless Chromium
//! driven by Playwright (`tests/browser/check_page.js`), it draws a band per pool, one row per
//! segment and the sites table, shows the figures when the chart is hovered and the
//! allocation (size, state, pool, stream, site, stack) when a block is, zooms by dragging and
//! resets, and asks the network for nothing.
//!
//! The browser part needs `/usr/bin/chromium` (Debian's `chromium`) and
//! `npm ci --prefix mempool-viz/tests/browser`; `.ci/run` installs both and sets
//! `MEMPOOL_BROWSER_TEST=1`, which makes their absence a failure rather than a skip.

use std::path::Path;
use std::process::Command;

use mempool_viz::SnapshotView;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn the_page_loads_nothing_from_anywhere() {
    let view = SnapshotView::read(format!("{DIR}/tests/fixtures/torch-multi.pickle")).unwrap();
    let html = mempool_viz::html::page(&view, None, None);
    for needle in ["src=", "href=", "https://", "@import", "url("] {
        assert!(!html.contains(needle), "{needle} in the page");
    }
    // The only address is the SVG namespace, a name, not a fetch.
    assert_eq!(html.matches("http://").count(), html.matches("http://www.w3.org/2000/svg").count());
    // A hostile string cannot close the data's script element.
    let mut v = view.clone();
    v.frames.push(mempool_viz::Frame {
        name: "</script><script>alert(1)</script>".into(),
        filename: "x".into(),
        line: 1,
    });
    let sid = v.stacks.len() as u32;
    v.stacks.push(vec![(v.frames.len() - 1) as u32]);
    v.segments[0].blocks[0].stack = sid;
    v.segments[0].blocks[0].state = "active_allocated".into();
    let html = mempool_viz::html::page(&v, None, None);
    assert_eq!(html.matches("</script>").count(), 2, "only the page's own two script elements close");
}

#[test]
fn the_page_in_headless_chromium() {
    let required = std::env::var("MEMPOOL_BROWSER_TEST").is_ok_and(|v| v == "1");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let driver = format!("{DIR}/tests/browser/node_modules/playwright-core");
    if !Path::new(&chromium).exists() || !Path::new(&driver).exists() {
        assert!(!required, "MEMPOOL_BROWSER_TEST=1 but {chromium} or {driver} is missing");
        eprintln!("skipped: no {chromium} or no {driver} (see this file's header)");
        return;
    }
    let view = SnapshotView::read(format!("{DIR}/tests/fixtures/torch-multi.pickle")).unwrap();
    let dir = std::env::temp_dir().join(format!("mempool-viz-page-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("page.html");
    mempool_viz::html::write_page(&view, None, None, &page).unwrap();
    // What the first allocated block drawn must say when hovered.
    let (seg, block) = view
        .segments
        .iter()
        .find_map(|s| s.blocks.iter().find(|b| b.state == "active_allocated").map(|b| (s, b)))
        .unwrap();
    let pool = if seg.pool == 0 { "default pools".to_string() } else { format!("pool {}", seg.pool) };
    let site = view.site(block.stack).unwrap().to_string();
    let expect = format!(
        r#"{{"pools":{},"segments":{},"sites":{},"blockText":[{:?},{:?},{:?}]}}"#,
        view.timeline().pools.len(),
        view.segments.len(),
        view.top_sites(10).len(),
        format!("{pool}, stream {}, device {}", seg.stream, seg.device),
        format!("block 0x{:x}", block.address),
        format!("site {site}")
    );
    let shot = std::env::var("MEMPOOL_VIZ_SCREENSHOT").unwrap_or_else(|_| dir.join("page.png").display().to_string());
    let out = Command::new("node")
        .arg(format!("{DIR}/tests/browser/check_page.js"))
        .arg(&page)
        .arg(&shot)
        .arg(&expect)
        .env("CHROMIUM", &chromium)
        .output()
        .expect("node");
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000, "a screenshot was taken");
    std::fs::remove_dir_all(&dir).ok();
}
