// The edgefl dashboard (docs/dashboard.md). Read-only: it GETs the summary stream
// (/api/events), the rounds kept (/api/history) and pages of the fleet table
// (/api/devices). Every text from the server goes into the page through textContent:
// device ids and refusal texts come from the devices (and from attackers).
"use strict";

(function () {
  const HISTORY_MAX = 1000; // rounds drawn (the telemetry keeps as many)
  const TABLE_EVERY_MS = 5000; // the table's page is fetched again this often ...
  const TABLE_MIN_GAP_MS = 2000; // ... and on a new snapshot, at most this often
  const COLORS = ["#2563eb", "#db2777", "#059669", "#d97706", "#7c3aed", "#0891b2", "#4b5563"];

  const $ = (id) => document.getElementById(id);
  const history = new Map(); // round -> point
  let latest = null; // the last summary
  let clockOffset = 0; // server time - local time, seconds
  let accChart = null;
  let accKey = "";
  let bytesChart = null;

  const table = {
    offset: 0, limit: 50, sort: "device_id", order: "asc", state: "all", q: "",
    seq: 0, fetchedAt: 0, version: -1, total: 0,
  };

  // -- formatting ---------------------------------------------------------------------

  function text(id, value) {
    const el = $(id);
    if (el) el.textContent = value;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    let v = Number(n);
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
    const digits = i === 0 || Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
    return v.toFixed(digits) + " " + units[i];
  }

  function serverNow() { return Date.now() / 1000 + clockOffset; }

  function ago(t) {
    if (t === null || t === undefined) return "never";
    const s = Math.max(0, serverNow() - t);
    if (s < 90) return Math.round(s) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    if (s < 172800) return Math.round(s / 3600) + " h ago";
    return Math.round(s / 86400) + " d ago";
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return d.toTimeString().slice(0, 8);
  }

  function pct(v) { return v === null || v === undefined ? "–" : v.toFixed(1) + "%"; }

  // -- the summary ----------------------------------------------------------------------

  function onSummary(s) {
    if (!s.ready) return;
    latest = s;
    clockOffset = s.at - Date.now() / 1000;
    text("fleet", s.fleet);
    text("strategy", s.strategy);
    document.title = "edgefl · " + s.fleet + " · round " + s.round;
    text("round", s.round + " / " + s.rounds_planned);
    text("phase", s.phase);
    text("answered", s.answered + " / " + s.selected);
    text("completed", s.rounds_completed + " round(s) closed");
    text("online", String(s.online));
    text("registered", "of " + s.registered + " registered"
      + (s.enrolments ? " · " + s.enrolments + " enrolled" : ""));
    text("traffic", bytes(s.bytes_up) + " / " + bytes(s.bytes_down));
    const updates = Object.entries(s.updates).map(([k, v]) => k + " " + v);
    text("updates", updates.length ? "updates: " + updates.join(", ") : "no update yet");
    const kinds = Object.entries(s.refusals).filter(([, v]) => v > 0);
    text("refusal-count", String(kinds.reduce((a, [, v]) => a + v, 0)));
    text("refusal-kinds", kinds.map(([k, v]) => k + " " + v).join(", "));
    const names = Object.keys(s.models).sort();
    if (names.length) {
      text("latest-amp", pct(s.models[names[0]].amp));
      text("latest-models", names.map((n) => n + " " + pct(s.models[n].amp)
        + " (WLP " + pct(s.models[n].wlp) + ")").join(" · "));
    }
    for (const p of s.history) history.set(p.round, p);
    trimHistory();
    drawCharts();
    drawRefusals(s.recent_refusals);
    tick();
    if (s.version !== table.version && Date.now() - table.fetchedAt >= TABLE_MIN_GAP_MS) {
      fetchTable();
    }
  }

  function trimHistory() {
    if (history.size <= HISTORY_MAX) return;
    const rounds = [...history.keys()].sort((a, b) => a - b);
    for (const r of rounds.slice(0, rounds.length - HISTORY_MAX)) history.delete(r);
  }

  function tick() {
    if (!latest) return;
    if (latest.deadline === null || latest.phase !== "training") {
      text("countdown", "–");
      text("deadline", latest.phase === "finished" ? "the run is over" : "");
      return;
    }
    const left = latest.deadline - serverNow();
    if (left <= 0) {
      text("countdown", "0:00");
    } else {
      const m = Math.floor(left / 60);
      const sec = Math.floor(left % 60);
      text("countdown", m + ":" + String(sec).padStart(2, "0"));
    }
    text("deadline", "at " + clock(latest.deadline));
  }

  function drawRefusals(list) {
    const ol = $("refusals");
    const items = [];
    for (const r of list.slice().reverse()) {
      const li = document.createElement("li");
      const when = document.createElement("span");
      when.className = "when";
      when.textContent = clock(r.at);
      const kind = document.createElement("span");
      kind.className = "kind";
      kind.textContent = r.kind;
      const body = document.createElement("span");
      body.textContent = r.text;
      li.append(when, kind, body);
      items.push(li);
    }
    ol.replaceChildren(...items);
    $("refusals-empty").hidden = items.length > 0;
  }

  // -- the charts (uPlot) ---------------------------------------------------------------

  function chartWidth(el) { return Math.max(300, el.clientWidth || 600); }

  function drawCharts() {
    const rounds = [...history.keys()].sort((a, b) => a - b);
    const points = rounds.map((r) => history.get(r));
    // accuracy: one AMP and one WLP series per model evaluated
    const names = new Set();
    for (const p of points) for (const n of Object.keys(p.models)) names.add(n);
    const models = [...names].sort();
    const series = [];
    for (const m of models) for (const metric of ["amp", "wlp"]) series.push([m, metric]);
    const accEl = $("acc-chart");
    const evaluated = points.filter((p) => models.some((m) => p.models[m] && p.models[m].amp !== undefined && p.models[m].amp !== null));
    accEl.dataset.points = String(evaluated.length);
    $("acc-empty").hidden = evaluated.length > 0;
    if (models.length) {
      const data = [rounds];
      for (const [m, metric] of series) {
        data.push(points.map((p) => (p.models[m] && p.models[m][metric] !== undefined ? p.models[m][metric] : null)));
      }
      const key = series.map((s) => s.join(":")).join(",");
      if (!accChart || key !== accKey) {
        if (accChart) accChart.destroy();
        accKey = key;
        accChart = new uPlot({
          width: chartWidth(accEl),
          height: 230,
          scales: { x: { time: false } },
          legend: { live: false },
          axes: [{ label: "round" }, { label: "%" }],
          series: [{ label: "round" }].concat(series.map(([m, metric], i) => ({
            label: m + " " + metric.toUpperCase(),
            stroke: COLORS[Math.floor(i / 2) % COLORS.length],
            width: 2,
            dash: metric === "wlp" ? [6, 4] : undefined,
            spanGaps: true,
            points: { show: true, size: 5 },
            value: (u, v) => (v === null || v === undefined ? "–" : v.toFixed(1) + "%"),
          }))),
        }, data, accEl);
      } else {
        accChart.setData(data);
      }
    }
    const bytesEl = $("bytes-chart");
    bytesEl.dataset.points = String(points.length);
    const bdata = [rounds, points.map((p) => p.bytes_up), points.map((p) => p.bytes_down)];
    if (!bytesChart) {
      bytesChart = new uPlot({
        width: chartWidth(bytesEl),
        height: 230,
        scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(1, max) * 1.1] } },
        legend: { live: false },
        axes: [{ label: "round" }, { size: 70, values: (u, vals) => vals.map((v) => bytes(v)) }],
        series: [
          { label: "round" },
          { label: "up", stroke: COLORS[0], width: 2, points: { show: true, size: 5 }, value: (u, v) => bytes(v) },
          { label: "down", stroke: COLORS[1], width: 2, points: { show: true, size: 5 }, value: (u, v) => bytes(v) },
        ],
      }, bdata, bytesEl);
    } else {
      bytesChart.setData(bdata);
    }
  }

  function resize() {
    if (accChart) accChart.setSize({ width: chartWidth($("acc-chart")), height: 230 });
    if (bytesChart) bytesChart.setSize({ width: chartWidth($("bytes-chart")), height: 230 });
  }

  // -- the fleet table --------------------------------------------------------------------

  function cell(tr, value, cls) {
    const td = document.createElement("td");
    td.textContent = value;
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  async function fetchTable() {
    const seq = ++table.seq;
    table.fetchedAt = Date.now();
    const params = new URLSearchParams({
      offset: String(table.offset), limit: String(table.limit), sort: table.sort,
      order: table.order, state: table.state, q: table.q,
    });
    let page;
    try {
      const response = await fetch("/api/devices?" + params.toString(), { credentials: "same-origin" });
      if (!response.ok) return;
      page = await response.json();
    } catch (e) {
      return;
    }
    if (seq !== table.seq) return; // a newer request was made meanwhile
    table.version = page.version;
    table.total = page.total;
    if (page.at && !latest) clockOffset = page.at - Date.now() / 1000;
    const rows = page.rows.map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.deviceId = r.device_id;
      tr.dataset.online = r.online ? "true" : "false";
      const id = cell(tr, r.device_id, "id");
      id.title = r.device_id;
      cell(tr, r.group);
      const prec = cell(tr, r.precisions);
      prec.title = "down/up; weights " + r.weight_format;
      cell(tr, r.online ? "online" : "offline", r.online ? "state-online" : "state-offline");
      cell(tr, r.online && r.last_seen !== null && serverNow() - r.last_seen < 2 ? "now" : ago(r.last_seen));
      cell(tr, String(r.rounds_answered), "num");
      cell(tr, r.last_outcome === null ? "–" : r.last_outcome,
        r.last_outcome === null ? "" : (r.last_outcome === "ok" ? "outcome-ok" : "outcome-other"));
      cell(tr, r.screening_ratio === null ? "–" : r.screening_ratio.toFixed(2), "num");
      cell(tr, bytes(r.bytes_up), "num");
      cell(tr, bytes(r.bytes_down), "num");
      return tr;
    });
    $("devices").tBodies[0].replaceChildren(...rows);
    const first = page.total ? page.offset + 1 : 0;
    const last = Math.min(page.offset + page.rows.length, page.total);
    text("page-info", first + "–" + last + " of " + page.total
      + (page.total !== page.registered ? " (" + page.registered + " registered)" : ""));
    $("prev").disabled = table.offset === 0;
    $("next").disabled = table.offset + table.limit >= page.total;
  }

  function sortHeaders() {
    for (const th of document.querySelectorAll("#devices th[data-sort]")) {
      if (th.dataset.sort === table.sort) {
        th.setAttribute("aria-sort", table.order === "asc" ? "ascending" : "descending");
      } else {
        th.removeAttribute("aria-sort");
      }
    }
  }

  function wireTable() {
    for (const th of document.querySelectorAll("#devices th[data-sort]")) {
      th.addEventListener("click", () => {
        const key = th.dataset.sort;
        if (table.sort === key) {
          table.order = table.order === "asc" ? "desc" : "asc";
        } else {
          table.sort = key;
          table.order = key === "device_id" || key === "group" || key === "precisions" ? "asc" : "desc";
        }
        table.offset = 0;
        sortHeaders();
        fetchTable();
      });
    }
    $("state").addEventListener("change", (e) => { table.state = e.target.value; table.offset = 0; fetchTable(); });
    $("limit").addEventListener("change", (e) => { table.limit = Number(e.target.value); table.offset = 0; fetchTable(); });
    let typing = null;
    $("search").addEventListener("input", (e) => {
      clearTimeout(typing);
      typing = setTimeout(() => { table.q = e.target.value.slice(0, 64); table.offset = 0; fetchTable(); }, 250);
    });
    $("prev").addEventListener("click", () => { table.offset = Math.max(0, table.offset - table.limit); fetchTable(); });
    $("next").addEventListener("click", () => {
      if (table.offset + table.limit < table.total) { table.offset += table.limit; fetchTable(); }
    });
    sortHeaders();
  }

  // -- the stream -------------------------------------------------------------------------

  function connState(state, label) {
    const el = $("conn");
    el.dataset.state = state;
    el.textContent = label;
  }

  async function loadHistory() {
    try {
      const response = await fetch("/api/history", { credentials: "same-origin" });
      if (response.status === 401) { connState("lost", "not authorised: open /?token=TOKEN"); return; }
      if (!response.ok) return;
      const body = await response.json();
      for (const p of body.history) if (!history.has(p.round)) history.set(p.round, p);
      trimHistory();
      drawCharts();
    } catch (e) { /* the stream retries */ }
  }

  function connect() {
    const source = new EventSource("/api/events");
    source.addEventListener("open", () => connState("live", "live"));
    source.addEventListener("summary", (e) => {
      connState("live", "live");
      try { onSummary(JSON.parse(e.data)); } catch (err) { console.error(err); }
    });
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) {
        connState("lost", "disconnected: retrying…");
        setTimeout(() => { loadHistory(); connect(); }, 5000);
      } else {
        connState("lost", "reconnecting…");
      }
    });
  }

  function start() {
    wireTable();
    loadHistory();
    fetchTable();
    connect();
    setInterval(tick, 250);
    setInterval(() => { if (Date.now() - table.fetchedAt >= TABLE_EVERY_MS - 50) fetchTable(); }, 1000);
    let pending = null;
    window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(resize, 150); });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
