// linserve's page: the live latency chart and the streamed-text sink (loaded before app.js). Everything is
// put into the page as text or SVG attributes, never as HTML.
"use strict";

// ------------------------------------------------------------------ the latency chart
// The page's own work per token must stay constant, or a long run would slow the browser down and skew the
// very timestamps it charts: latencies go into blocks of BLOCK (their max and median kept) and a log-scale
// histogram (for p50/p99) as they arrive; a redraw (at most 4 a second) reads those, never the raw list.
const REDRAW_MS = 250, COLUMNS = 600, BLOCK = 8, BINS_PER_DECADE = 40, LOWEST_MS = 0.01;
const chart = { pending: false, flushers: [] };

function resetChart() {
  Object.assign(chart, { count: 0, first: null, last: null, block: [], maxes: [], medians: [], highest: 0,
                         histogram: new Array(8 * BINS_PER_DECADE).fill(0) });
}

function quantile(sorted, q) {
  return sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] : NaN;
}

function histogramQuantile(q) { // the upper edge of the bin holding quantile q
  let seen = 0;
  for (let bin = 0; bin < chart.histogram.length; bin++) {
    seen += chart.histogram[bin];
    if (seen >= q * chart.count) return LOWEST_MS * 10 ** ((bin + 1) / BINS_PER_DECADE);
  }
  return NaN;
}

function addGap(ms) {
  chart.count += 1;
  chart.highest = Math.max(chart.highest, ms);
  const bin = Math.max(0, Math.floor(BINS_PER_DECADE * Math.log10(Math.max(ms, LOWEST_MS) / LOWEST_MS)));
  chart.histogram[Math.min(bin, chart.histogram.length - 1)] += 1;
  chart.block.push(ms);
  if (chart.block.length === BLOCK) {
    const sorted = chart.block.sort((a, b) => a - b);
    chart.maxes.push(sorted[BLOCK - 1]);
    chart.medians.push(quantile(sorted, 0.5));
    chart.block = [];
  }
}

function svg(name, attributes, parent) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// runs of `per` consecutive blocks → [token index of the run's middle, combine(the run's values)]
function merged(values, per, combine) {
  const out = [];
  for (let start = 0; start + per <= values.length; start += per) {
    out.push([(start + per / 2) * BLOCK, combine(values.slice(start, start + per))]);
  }
  return out;
}

function drawChart() {
  chart.pending = false;
  for (const flush of chart.flushers) flush();
  const box = document.getElementById("itl-chart");
  box.replaceChildren();
  box.dataset.points = String(chart.count);
  if (!chart.count) return;
  const p50 = histogramQuantile(0.5), p99 = histogramQuantile(0.99);
  const top = Math.max(p99 * 1.5, 1e-3); // outliers above 1.5 × the p99 are drawn at the top edge
  const [left, right, upper, lower] = [58, 632, 10, 196];
  const x = (i) => left + (right - left) * Math.min(i / Math.max(chart.count - 1, 1), 1);
  const y = (ms) => lower - (lower - upper) * Math.min(ms / top, 1);
  const line = (pairs, cls) => svg("polyline", {
    points: pairs.map(([i, v]) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" "), class: cls }, box);
  svg("line", { x1: left, y1: lower, x2: right, y2: lower, class: "axis" }, box);
  svg("line", { x1: left, y1: upper, x2: left, y2: lower, class: "axis" }, box);
  for (const share of [0, 0.5, 1]) { // the y scale, in ms
    svg("text", { x: left - 4, y: y(top * share) + 4, class: "label tick", "text-anchor": "end" }, box)
      .textContent = `${(top * share).toFixed(top < 10 ? 1 : 0)} ms`;
  }
  for (const [value, name] of [[p50, "p50"], [p99, "p99"]]) {
    svg("line", { x1: left, y1: y(value), x2: right, y2: y(value), class: "guide " + name }, box);
    svg("text", { x: right - 2, y: y(value) - 3, class: "label", "text-anchor": "end" }, box)
      .textContent = `${name} ${value.toFixed(2)} ms`;
  }
  if (chart.highest > top) { // said, not hidden: the scale stops at 1.5 × p99
    svg("text", { x: left + 4, y: upper + 10, class: "label clipped" }, box).textContent =
      `clipped: latencies above ${top.toFixed(1)} ms (1.5 × p99) are drawn at the top; highest ${chart.highest.toFixed(1)} ms`;
  }
  // the latency between tokens i-1 and i is token i's: the first is token 2's, the last the last token's
  svg("text", { x: left, y: 214, class: "label" }, box).textContent = "token 2";
  svg("text", { x: right, y: 214, class: "label", "text-anchor": "end" }, box).textContent = `token ${chart.count + 1}`;
  // thin: the largest latency of each column; thick: the median of each of ~100 windows (the median of its
  // blocks' medians) — flat when latency does not grow with the context
  const blocks = chart.maxes.length;
  line(merged(chart.maxes, Math.max(1, Math.ceil(blocks / COLUMNS)), (run) => Math.max(...run)), "itl");
  const trend = merged(chart.medians, Math.max(1, Math.floor(blocks / 100)),
                       (run) => quantile(run.sort((a, b) => a - b), 0.5));
  if (trend.length > 1) line(trend, "trend");
  const seconds = (chart.last - chart.first) / 1000;
  document.getElementById("itl-stats").textContent = `${chart.count + 1} tokens · ${(chart.count / Math.max(seconds, 1e-9)).toFixed(1)} `
    + `tokens/s · inter-token latency p50 ≤ ${p50.toFixed(2)} ms, p99 ≤ ${p99.toFixed(2)} ms (this browser's clock)`;
}

function scheduleDraw() {
  if (!chart.pending) { chart.pending = true; setTimeout(drawChart, REDRAW_MS); }
}

function tokenArrived() {
  const now = performance.now();
  if (chart.last !== null) addGap(now - chart.last);
  else chart.first = now;
  chart.last = now;
  scheduleDraw();
}

// Streamed text for `element`, added to one text node with each redraw (text, never HTML). Only the last
// SHOWN_CHARS stay on the page: laying out a text that grows with the stream would cost more every redraw.
const SHOWN_CHARS = 20000;

function textSink(element, initial = "") {
  const node = document.createTextNode(initial);
  element.replaceChildren(node);
  let pending = "";
  const flush = () => {
    if (!pending) return;
    node.appendData(pending);
    pending = "";
    if (node.length > SHOWN_CHARS) node.deleteData(0, node.length - SHOWN_CHARS);
    element.scrollTop = element.scrollHeight;
  };
  chart.flushers = [flush];
  return { add(text) { pending += text; scheduleDraw(); }, flush };
}

