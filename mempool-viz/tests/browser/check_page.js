// Loads a mempool-viz page in the system's headless Chromium and checks what a user sees:
// the timeline's bands and reserved line, the hover text over the chart and over a block,
// zooming by dragging and resetting, and the sites table. Writes a screenshot.
//
//   node check_page.js PAGE.html SCREENSHOT.png EXPECT_JSON
//
// EXPECT_JSON: {"pools": N, "segments": N, "blockText": ["...", ...], "sites": N}
"use strict";
const { chromium } = require("playwright-core");

function fail(msg) {
  console.error("check_page: " + msg);
  process.exit(1);
}

(async () => {
  const [page_path, shot, expectJson] = process.argv.slice(2);
  const expect = JSON.parse(expectJson);
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  const requests = [];
  const errors = [];
  const ctx = await browser.newContext({ viewport: { width: 1100, height: 1300 } });
  const page = await ctx.newPage();
  page.on("request", (r) => { if (!r.url().startsWith("file://")) requests.push(r.url()); });
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto("file://" + page_path);
  await page.waitForSelector("body[data-ready='1']", { timeout: 20000 });
  if (errors.length) fail("script errors: " + errors.join("; "));

  const bands = await page.$$eval("#timeline path.band", (ps) => ps.length);
  if (bands !== expect.pools) fail(`${bands} pool bands, expected ${expect.pools}`);
  if ((await page.$$("#timeline path.reserved")).length !== 1) fail("no reserved line");
  const rows = await page.$$eval("#segment-view g.segment", (g) => g.length);
  if (rows !== expect.segments) fail(`${rows} segment rows, expected ${expect.segments}`);
  const sites = await page.$$eval("#sites tbody tr", (r) => r.length);
  if (sites !== expect.sites) fail(`${sites} site rows, expected ${expect.sites}`);

  // Hover the middle of the chart: the figures at that time.
  const box = await (await page.$("#timeline")).boundingBox();
  await page.mouse.move(box.x + box.width * 0.7, box.y + box.height * 0.5);
  const chartTip = await page.$eval("#tooltip", (t) => (t.style.display === "block" ? t.textContent : ""));
  if (!/t = [0-9.]+ ms/.test(chartTip) || !chartTip.includes("reserved:")) fail("chart hover text: " + chartTip);

  // Drag to zoom into the last fifth, then reset.
  const before = await page.$eval("#range", (r) => r.textContent);
  await page.mouse.move(box.x + box.width * 0.8, box.y + box.height * 0.5);
  await page.mouse.down();
  await page.mouse.move(box.x + box.width * 0.9, box.y + box.height * 0.5, { steps: 4 });
  await page.mouse.up();
  const zoomed = await page.$eval("#range", (r) => r.textContent);
  if (zoomed === before) fail("dragging did not zoom: " + zoomed);
  await page.click("#reset");
  const reset = await page.$eval("#range", (r) => r.textContent);
  if (reset !== before) fail("reset did not restore the range: " + reset);

  // Hover the first allocated block: its size, state, pool, stream and stack.
  const block = await page.$("#segment-view rect.block.active_allocated");
  if (!block) fail("no allocated block drawn");
  await block.hover();
  const blockTip = await page.$eval("#tooltip", (t) => (t.style.display === "block" ? t.textContent : ""));
  for (const want of ["size ", "state active_allocated", "stream ", "segment 0x"].concat(expect.blockText)) {
    if (!blockTip.includes(want)) fail(`block hover text lacks ${JSON.stringify(want)}: ${blockTip}`);
  }
  await page.mouse.move(box.x + box.width * 0.6, box.y + box.height * 0.4);
  await page.screenshot({ path: shot, fullPage: false });
  await browser.close();
  if (requests.length) fail("the page asked the network for: " + requests.join(", "));
  console.log(JSON.stringify({ bands, rows, sites, chartTip, blockTip: blockTip.split("\n").slice(0, 6) }));
})().catch((e) => fail(String(e && e.stack ? e.stack : e)));
