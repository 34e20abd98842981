// mempool-viz's offline page: draws the snapshot embedded in #snapshot-data. No network, no
// library: plain DOM and SVG.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("snapshot-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const STATES = ["active_allocated", "active_pending_free", "inactive"];
  const tip = document.getElementById("tooltip");

  function human(b) {
    if (b >= 2 ** 30) return (b / 2 ** 30).toFixed(2) + " GiB";
    if (b >= 2 ** 20) return (b / 2 ** 20).toFixed(2) + " MiB";
    if (b >= 1024) return (b / 1024).toFixed(2) + " KiB";
    return b + " B";
  }
  function hex(n) {
    return "0x" + n.toString(16);
  }
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function poolName(p) {
    // The band of the pools beyond the sixteenth (u64::MAX, inexact as a JS number).
    if (p >= 1.8e19) return "other pools";
    return p === 0 ? "default pools" : "pool " + p;
  }
  function stackText(id) {
    const st = D.stacks[id];
    if (!st || st.f.length === 0) return "(no stack recorded)";
    return (
      "site " +
      st.site +
      "\nstack, innermost first:\n" +
      st.f
      .map((f) => {
        const fr = D.frames[f];
        return fr[1] && fr[1] !== "??" && fr[2] > 0 ? fr[0] + " (" + fr[1] + ":" + fr[2] + ")" : fr[0];
      })
      .join("\n")
    );
  }
  function showTip(ev, text) {
    tip.textContent = text;
    tip.style.display = "block";
    const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const y = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
    tip.style.left = Math.max(0, x) + window.scrollX + "px";
    tip.style.top = Math.max(0, y) + window.scrollY + "px";
  }
  function hideTip() {
    tip.style.display = "none";
  }

  // ---- header and legend ----
  document.getElementById("title").textContent = D.title;
  const legend = document.getElementById("legend");
  D.pools.forEach((p, i) => {
    const item = document.createElement("span");
    item.className = "legend-item";
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = COLORS[i % COLORS.length];
    item.appendChild(sw);
    item.appendChild(document.createTextNode("allocated, " + poolName(p)));
    legend.appendChild(item);
  });
  const ritem = document.createElement("span");
  ritem.className = "legend-item";
  ritem.innerHTML = '<span class="swatch reserved-swatch"></span>reserved, all pools';
  legend.appendChild(ritem);

  // ---- timeline ----
  const W = 1000,
    H = 380,
    ML = 80,
    MR = 20,
    MT = 16,
    MB = 46;
  const svg = document.getElementById("timeline");
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  const n = D.t.length;
  const stacked = D.t.map((_, k) => {
    let acc = 0;
    return D.a.map((col) => (acc += col[k]));
  });
  let domain = n ? [D.t[0], Math.max(D.t[n - 1], D.t[0] + 1e-3)] : [0, 1];
  const full = domain.slice();

  function first(t) {
    // The last point at or before t.
    let lo = 0,
      hi = n - 1;
    if (n === 0 || t < D.t[0]) return -1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (D.t[mid] <= t) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  function draw() {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const [t0, t1] = domain;
    const i0 = Math.max(0, first(t0)),
      i1 = Math.max(0, first(t1));
    let ymax = 1;
    for (let k = i0; k <= i1 && k < n; k++) {
      ymax = Math.max(ymax, D.r[k], stacked[k][stacked[k].length - 1] || 0);
    }
    ymax *= 1.08;
    const x = (t) => ML + ((t - t0) / (t1 - t0)) * (W - ML - MR);
    const y = (v) => H - MB - (v / ymax) * (H - MT - MB);
    // axes and grid
    const g = el("g", { class: "axes" }, svg);
    for (let k = 0; k <= 5; k++) {
      const v = (ymax / 1.08) * (k / 5);
      el("line", { x1: ML, x2: W - MR, y1: y(v), y2: y(v), class: "grid" }, g);
      el("text", { x: ML - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, g).textContent = human(Math.round(v));
    }
    for (let k = 0; k <= 8; k++) {
      const t = t0 + ((t1 - t0) * k) / 8;
      el("text", { x: x(t), y: H - MB + 16, "text-anchor": "middle", class: "tick" }, g).textContent = t.toFixed(t1 - t0 < 10 ? 2 : 0);
    }
    el("text", { x: (ML + W - MR) / 2, y: H - 8, "text-anchor": "middle", class: "axis-label" }, g).textContent =
      "time since the first recorded event (ms)";
    // the points in view, as steps, clipped to the domain
    const idx = [];
    for (let k = i0; k <= i1 && k < n; k++) idx.push(k);
    const clip = (t) => Math.min(Math.max(t, t0), t1);
    function stepPath(val) {
      if (!idx.length) return "";
      let d = "M" + x(clip(D.t[idx[0]])) + "," + y(val(idx[0]));
      for (let j = 1; j < idx.length; j++) {
        const k = idx[j];
        d += "H" + x(clip(D.t[k])) + "V" + y(val(k));
      }
      return d + "H" + x(t1);
    }
    for (let p = D.pools.length - 1; p >= 0; p--) {
      const top = stepPath((k) => stacked[k][p]);
      if (!top) continue;
      el(
        "path",
        {
          d: top + "V" + y(0) + "H" + x(clip(D.t[idx[0]])) + "Z",
          class: "band",
          "data-pool": D.pools[p],
          fill: COLORS[p % COLORS.length],
        },
        svg
      );
    }
    const rp = stepPath((k) => D.r[k]);
    if (rp) el("path", { d: rp, class: "reserved" }, svg);
    el("rect", { x: ML, y: MT, width: W - ML - MR, height: H - MT - MB, class: "overlay" }, svg);
    el("line", { x1: 0, x2: 0, y1: MT, y2: H - MB, class: "cursor", visibility: "hidden" }, svg);
    el("rect", { x: 0, y: MT, width: 0, height: H - MT - MB, class: "selection", visibility: "hidden" }, svg);
    document.getElementById("range").textContent =
      "showing " + t0.toFixed(3) + " to " + t1.toFixed(3) + " ms of " + full[0].toFixed(3) + " to " + full[1].toFixed(3);
  }

  function timeAt(ev) {
    const r = svg.getBoundingClientRect();
    const px = ((ev.clientX - r.left) / r.width) * W;
    const f = (px - ML) / (W - ML - MR);
    return domain[0] + Math.min(Math.max(f, 0), 1) * (domain[1] - domain[0]);
  }
  function pxOf(t) {
    return ML + ((t - domain[0]) / (domain[1] - domain[0])) * (W - ML - MR);
  }
  let dragFrom = null;
  svg.addEventListener("mousemove", (ev) => {
    const t = timeAt(ev);
    const cur = svg.querySelector(".cursor");
    cur.setAttribute("x1", pxOf(t));
    cur.setAttribute("x2", pxOf(t));
    cur.setAttribute("visibility", "visible");
    if (dragFrom !== null) {
      const sel = svg.querySelector(".selection");
      const a = pxOf(Math.min(dragFrom, t)),
        b = pxOf(Math.max(dragFrom, t));
      sel.setAttribute("x", a);
      sel.setAttribute("width", b - a);
      sel.setAttribute("visibility", "visible");
    }
    const k = first(t);
    if (k < 0) {
      showTip(ev, "t = " + t.toFixed(3) + " ms: before the trace");
      return;
    }
    const lines = ["t = " + t.toFixed(3) + " ms"];
    D.pools.forEach((p, i) => lines.push("allocated, " + poolName(p) + ": " + human(D.a[i][k])));
    lines.push("reserved: " + human(D.r[k]));
    showTip(ev, lines.join("\n"));
  });
  svg.addEventListener("mouseleave", () => {
    hideTip();
    svg.querySelector(".cursor").setAttribute("visibility", "hidden");
  });
  svg.addEventListener("mousedown", (ev) => {
    dragFrom = timeAt(ev);
    ev.preventDefault();
  });
  window.addEventListener("mouseup", (ev) => {
    if (dragFrom === null) return;
    const t = timeAt(ev);
    const a = Math.min(dragFrom, t),
      b = Math.max(dragFrom, t);
    dragFrom = null;
    if (b - a > (domain[1] - domain[0]) / 500) domain = [a, b];
    draw();
  });
  svg.addEventListener(
    "wheel",
    (ev) => {
      ev.preventDefault();
      const t = timeAt(ev);
      const s = ev.deltaY < 0 ? 0.8 : 1.25;
      let a = t - (t - domain[0]) * s,
        b = t + (domain[1] - t) * s;
      a = Math.max(a, full[0]);
      b = Math.min(b, full[1]);
      if (b - a > 1e-6) domain = [a, b];
      draw();
    },
    { passive: false }
  );
  document.getElementById("reset").addEventListener("click", () => {
    domain = full.slice();
    draw();
  });
  draw();

  // ---- segments ----
  const segDiv = document.getElementById("segments");
  const BW = 760;
  const shown = D.segments.slice(0, 2000);
  if (D.segments.length > shown.length) {
    const p = document.createElement("p");
    p.textContent = "The first " + shown.length + " of " + D.segments.length + " segments:";
    segDiv.appendChild(p);
  }
  const rowH = 18;
  const ssvg = el("svg", { id: "segment-view", viewBox: "0 0 1000 " + (shown.length * rowH + 4), width: "1000" }, segDiv);
  shown.forEach((s, r) => {
    const yy = r * rowH + 2;
    el("text", { x: 0, y: yy + 12, class: "seg-label" }, ssvg).textContent =
      "dev " + s.d + " " + poolName(s.pool) + " " + human(s.size) + (s.exp ? " (exp.)" : "");
    const g = el("g", { class: "segment", "data-address": hex(s.addr) }, ssvg);
    el("rect", { x: 230, y: yy, width: BW, height: rowH - 4, class: "segment-bg" }, g);
    s.blocks.forEach((b) => {
      const [off, size, req, st, stack] = b;
      const bx = 230 + (off / s.size) * BW;
      const bw = Math.max(1, (size / s.size) * BW);
      const rect = el("rect", { x: bx, y: yy, width: bw, height: rowH - 4, class: "block " + STATES[st] }, g);
      if (st !== 2) rect.setAttribute("fill", COLORS[Math.max(0, D.pools.indexOf(s.pool)) % COLORS.length]);
      rect.addEventListener("mousemove", (ev) => {
        showTip(
          ev,
          "block " +
            hex(s.addr + off) +
            "\nsize " +
            human(size) +
            (st === 2 ? "" : " (requested " + human(req) + ")") +
            "\nstate " +
            STATES[st] +
            "\n" +
            poolName(s.pool) +
            ", stream " +
            s.stream +
            ", device " +
            s.d +
            "\nsegment " +
            hex(s.addr) +
            " (" +
            human(s.size) +
            ")\n" +
            (st === 2 ? "" : stackText(stack))
        );
      });
      rect.addEventListener("mouseleave", hideTip);
    });
  });

  // ---- sites ----
  const tb = document.querySelector("#sites tbody");
  if (!D.sites.length) {
    document.getElementById("sites-none").style.display = "block";
  }
  D.sites.forEach((s) => {
    const tr = document.createElement("tr");
    [poolName(s.pool), human(s.bytes), String(s.blocks), s.site].forEach((v) => {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    });
    tb.appendChild(tr);
  });
  document.body.setAttribute("data-ready", "1");
})();
