// The dashboard's graphs: what the queues did, minute by minute. Reads
// /history.json (the History command) for the section's queue ("" for all)
// and draws it with the vendored uPlot (uPlot.iife.min.js, MIT), again
// every few seconds. The numbers it drew are left on the section as data
// attributes (data-created, ... : sums over the graph's minutes), for
// people's tools and the tests.
"use strict";

const THROUGHPUT = [
  ["created", "created", "#2457c5"],
  ["handedOut", "handed out", "#7c3aed"],
  ["finished", "finished", "#1a7f37"],
  ["failed", "failed", "#c0262d"],
  ["retried", "retried", "#9a6700"],
];
const DEPTH = [["depth", "queued", "#16213a"]];
const HEIGHT = 200;

function chartOptions(width, series) {
  return {
    width: width,
    height: HEIGHT,
    scales: {x: {time: true}, y: {range: (u, low, high) => [0, Math.max(1, high)]}},
    series: [{}, ...series.map(([, label, color]) => ({
      label: label, stroke: color, width: 1.5, points: {show: false},
    }))],
    // Whole jobs: no tick between 0 and 1.
    axes: [{}, {size: 50, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 1e5, 1e6]}],
    // The legend shows the newest minute's values whenever the pointer is
    // not over the chart (uPlot would show "--").
    hooks: {setLegend: [(u) => {
      if (u.legend.idx == null && u.data[0].length) u.setLegend({idx: u.data[0].length - 1}, false);
    }]},
  };
}

function widthOf(element) {
  return Math.max(280, element.clientWidth);
}

class Graphs {
  constructor(section) {
    this.section = section;
    this.queue = section.dataset.queue || "";
    this.minutes = Number(section.dataset.minutes) || 60;
    this.status = section.querySelector(".graph-status");
    this.places = {
      throughput: section.querySelector(".chart.throughput"),
      depth: section.querySelector(".chart.depth"),
    };
    this.charts = {};
  }

  url() {
    const query = new URLSearchParams({minutes: String(this.minutes)});
    if (this.queue) query.set("queue", this.queue);
    return "/history.json?" + query.toString();
  }

  async refresh() {
    let body;
    try {
      const reply = await fetch(this.url(), {cache: "no-store", credentials: "same-origin"});
      body = await reply.json();
      if (!reply.ok) {
        this.status.textContent = "History: " + (body.error || reply.status);
        return;
      }
    } catch (error) {
      // The server is away for now: the next tick tries again.
      this.status.textContent = "History: the server does not answer; trying again.";
      return;
    }
    this.draw(body);
  }

  draw(body) {
    const times = body.series.created.map((_, i) => body.startTime + i * body.interval);
    this.plot("throughput", THROUGHPUT, times, body.series);
    this.plot("depth", DEPTH, times, body.series);
    for (const [key] of [...THROUGHPUT, ...DEPTH]) {
      const values = body.series[key];
      const total = key === "depth" ? values[values.length - 1] : values.reduce((a, b) => a + b, 0);
      this.section.dataset[key] = String(total);
    }
    const now = new Date().toLocaleTimeString();
    // Without series of its own, a queue may still have been counted: in
    // the totals only, past the 100 queues a server graphs (History).
    let untracked = "";
    if (body.queue && !body.tracked) {
      untracked = body.other
        ? " No graphs of this queue now: this server keeps them for 100 queues, those at work;" +
          " the rest are counted in the totals only."
        : " Nothing counted for this queue yet.";
    }
    this.status.textContent =
      `Updated ${now}; kept by this server in memory since it started, ${body.window} minutes at most.` +
      untracked;
    this.section.dataset.drawn = String(Date.now());
  }

  plot(name, series, times, values) {
    const data = [times, ...series.map(([key]) => values[key])];
    const chart = this.charts[name];
    const place = this.places[name];
    if (chart === undefined) {
      this.charts[name] = new uPlot(chartOptions(widthOf(place), series), data, place);
    } else {
      chart.setData(data);
    }
  }

  resize() {
    for (const [name, chart] of Object.entries(this.charts)) {
      chart.setSize({width: widthOf(this.places[name]), height: HEIGHT});
    }
  }
}

for (const section of document.querySelectorAll("section.graphs[data-history]")) {
  const graphs = new Graphs(section);
  const seconds = Number(section.dataset.refresh) || 5;
  graphs.refresh();
  setInterval(() => graphs.refresh(), seconds * 1000);
  window.addEventListener("resize", () => graphs.resize());
}
