// The job page: live loss and throughput curves (uPlot), the job's share of each device it
// holds, the timeline of resizes with the pause each cost, the log tail, and the actions its
// owner may take. All live over the socket; nothing polls.
(function () {
  "use strict";
  const boot = BungeeLive.bootstrap();
  let job = boot.job;
  const $ = (sel) => document.querySelector(sel);
  const el = (tag, text, attrs) => {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    Object.entries(attrs || {}).forEach(([k, v]) => node.setAttribute(k, v));
    return node;
  };
  const bytes = (n) => {
    if (n === null || n === undefined) return "–";
    const units = [[1e9, " GB"], [1e6, " MB"], [1e3, " kB"]];
    const [size, unit] = units.find(([size]) => n >= size) || [1, " B"];
    return (n / size).toFixed(n >= size * 100 || size === 1 ? 0 : 1) + unit;
  };
  // Postgres keeps JSON keys in its own order; phases are shown in the order they happen.
  const PHASES = ["leave", "rendezvous", "exchange", "transfer", "first_step"];
  const phaseOrder = (name) => (PHASES.indexOf(name) + PHASES.length + 1) % (PHASES.length + 1);
  const compact = (v) => Math.abs(v) >= 1e4 ? (v / 1e3).toFixed(0) + "k" : String(v);
  const MAX_LOG_LINES = 500;
  const FINAL = ["succeeded", "failed", "cancelled"];

  // --- charts --------------------------------------------------------------------------------
  // The curve covers the whole run in at most CURVE_POINTS points (the API downsamples it); live
  // points are appended, and past twice that many it is fetched again, downsampled anew. A
  // rollback (every worker was gone, the job resumed from its checkpoint) cuts the run into
  // segments: the steps trained again after it are the run's line, the steps lost past it stay
  // as a faded line of their own, and a vertical marker says where it went back to.
  const CURVE_POINTS = 2000;
  let segments = [];  // per segment, its points in step order
  let rollbacks = boot.rollbacks || [];
  function setCurve(points, marked) {
    segments = [];
    points.forEach((p) => { (segments[p.segment] = segments[p.segment] || []).push(p); });
    segments = segments.filter(Boolean);
    rollbacks = marked;
  }
  setCurve(boot.metrics, rollbacks);
  const lastPoint = () => { const seg = segments[segments.length - 1]; return seg && seg[seg.length - 1]; };
  // Per segment, its line: the steps the run kept, up to where a later rollback went back to,
  // then (all but the last segment) the steps lost past it, trained again after the rollback.
  // Each is a series of its own, so the run's line breaks at every rollback.
  function lines() {
    if (!segments.length) return [[]];
    const parts = [];
    let limit = Infinity;
    for (let s = segments.length - 1; s >= 0; s--) {
      const kept = [], lost = [];
      segments[s].forEach((p) => (p.step <= limit ? kept : lost).push(p));
      parts.unshift(...(s < segments.length - 1 ? [kept, lost] : [kept]));
      if (s > 0) limit = Math.min(limit, rollbacks[s - 1].to_step);
    }
    return parts;
  }
  // uPlot wants one x array: the steps of every line, each line null where it has no point.
  function aligned(value) {
    const parts = lines();
    const xs = [...new Set(parts.flatMap((part) => part.map((p) => p.step)))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    return [xs, ...parts.map((part) => {
      const ys = new Array(xs.length).fill(null);
      part.forEach((p) => { ys[at.get(p.step)] = value(p); });
      return ys;
    })];
  }
  // After every draw (new data, a resize), each rollback's marker is put where its step is now;
  // the markers are kept and moved rather than made again.
  function placeMarkers(u) {
    const marks = [...u.over.querySelectorAll(".rollback-marker")];
    marks.slice(rollbacks.length).forEach((node) => node.remove());
    rollbacks.forEach((r, i) => {
      const mark = marks[i] || u.over.appendChild(el("div", undefined, { class: "rollback-marker" }));
      mark.title = "generation " + r.generation + " went back from step " + r.at_step_from + " to step " +
        r.to_step + " (its checkpoint): the steps after it were trained again";
      const label = "rolled back to step " + r.to_step;
      if (mark.textContent !== label) mark.replaceChildren(el("span", label));
      const left = Math.min(Math.max(u.valToPos(r.to_step, "x"), 0), u.over.clientWidth);
      mark.style.left = left + "px";
      // In the right half the label goes left of the line, so that it stays inside the chart.
      mark.classList.toggle("rollback-marker-left", left > u.over.clientWidth / 2);
    });
  }
  // Each resize of a running job (not its first start) is a thin line at the step it switched
  // at, labelled with the sizes; its title (a tooltip) says when and why. Labels of resizes close
  // together are stacked three high so that they do not cover each other.
  const resized = () => (job.resizes || []).filter((r) => r.workers_before > 0 && r.step !== null && r.step !== undefined);
  function placeResizeMarkers(u) {
    const shown = resized();
    const marks = [...u.over.querySelectorAll(".resize-marker")];
    marks.slice(shown.length).forEach((node) => node.remove());
    shown.forEach((r, i) => {
      const mark = marks[i] || u.over.appendChild(el("div", undefined, { class: "resize-marker" }));
      const label = r.workers_before + " → " + r.workers_after + " workers";
      if (mark.textContent !== label) mark.replaceChildren(el("span", label));
      mark.firstChild.title = "resized from " + r.workers_before + " to " + r.workers_after + " workers at step " +
        r.step + " (generation " + r.generation + ", " + r.reason + (r.pause_s === null || r.pause_s === undefined
          ? "" : ", paused " + r.pause_s.toFixed(2) + " s") + ")";
      mark.firstChild.style.bottom = (2 + (i % 3) * 20) + "px";
      const left = u.valToPos(r.step, "x");
      mark.hidden = !(left >= 0 && left <= u.over.clientWidth);
      mark.style.left = left + "px";
      mark.classList.toggle("resize-marker-left", left > u.over.clientWidth / 2);
    });
  }
  const css = getComputedStyle(document.documentElement);
  function chart(target, label, value, colour, previous) {
    if (previous) previous.destroy();
    const data = aligned(value);
    const width = Math.max(280, target.clientWidth || 480);
    return new uPlot({
      width: width, height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "step", stroke: css.getPropertyValue("--fg") },
        { stroke: css.getPropertyValue("--fg"), size: 56, values: (u, ticks) => ticks.map(compact) }],
      // Even series: the run's line; odd ones: steps lost at a rollback, faded and dashed.
      series: [{ label: "step" }, ...data.slice(1).map((_, i) => (i % 2
        ? { label: label + ", lost at rollback " + (i + 1) / 2, stroke: colour + "66", width: 1.5, dash: [6, 4], spanGaps: true }
        : { label: label, stroke: colour, width: 2, spanGaps: true }))],
      legend: { show: false },
      hooks: { draw: [placeMarkers, placeResizeMarkers] },
    }, data, target);
  }
  // A chart with no point says so over its empty axes, rather than leaving a blank box.
  function markEmpty(target) {
    let note = target.querySelector(".chart-empty");
    const empty = !segments.length;
    if (!empty) { if (note) note.remove(); return; }
    if (!note) note = target.appendChild(el("p", undefined, { class: "chart-empty" }));
    note.textContent = FINAL.includes(job.state) ? "no data: the job trained no step" : "no data yet";
  }
  let lossChart = null, speedChart = null;
  function drawCurves() {
    // A new rollback adds a line: the charts are built again; otherwise only their data changes.
    if (lossChart && lossChart.series.length === 2 * Math.max(segments.length, 1)) {
      lossChart.setData(aligned((p) => p.loss));
      speedChart.setData(aligned((p) => p.samples_per_s));
    } else {
      lossChart = chart($("#loss-chart"), "loss", (p) => p.loss, "#d9480f", lossChart);
      speedChart = chart($("#speed-chart"), "samples/s", (p) => p.samples_per_s, "#1c7ed6", speedChart);
    }
    markEmpty($("#loss-chart"));
    markEmpty($("#speed-chart"));
  }
  drawCurves();
  let reloading = false, reloadAgain = false;
  async function reloadCurve() {
    if (reloading) { reloadAgain = true; return; }
    reloading = true;
    try {
      const reply = await fetch("/api/jobs/" + job.id + "/metrics?points=" + CURVE_POINTS, { credentials: "same-origin" });
      if (reply.ok) {
        const curve = await reply.json();
        setCurve(curve.points, curve.rollbacks);
        drawCurves(); renderFacts();
      }
    } finally {
      reloading = false;
      if (reloadAgain) { reloadAgain = false; reloadCurve(); }
    }
  }
  // A live point: appended, unless the curve already has it; one of a newer generation at a
  // step already reported is a rollback, which the API marks: the curve is fetched again.
  function addPoint(msg) {
    const last = lastPoint();
    if (last && msg.step <= last.step) {
      if (msg.generation > last.generation) reloadCurve();
      return;
    }
    const point = { generation: msg.generation, segment: last ? last.segment : 0, step: msg.step, loss: msg.loss,
      samples_per_s: msg.samples_per_s };
    if (!segments.length) segments.push([]);
    segments[segments.length - 1].push(point);
    if (segments.reduce((n, seg) => n + seg.length, 0) > 2 * CURVE_POINTS) reloadCurve();
    else drawCurves();
  }
  function rollbackNote() {
    const latest = rollbacks[rollbacks.length - 1];
    if (!latest || job.steps_done > latest.at_step_from) return "";
    return " (rolled back from step " + latest.at_step_from + " to " + latest.to_step + ")";
  }
  // The task's named metrics: "name (train)" from loss, "name (eval)" from evaluate, on one
  // step axis (gaps where a series has no point); the chart is rebuilt when a name appears.
  const named = new Map();  // series label -> Map(step -> value)
  function addNamed(step, metrics, kind) {
    let added = false;
    Object.entries(metrics || {}).forEach(([name, value]) => {
      const label = name + " (" + kind + ")";
      if (!named.has(label)) { named.set(label, new Map()); added = true; }
      named.get(label).set(step, value);
    });
    return added;
  }
  boot.metrics.forEach((m) => addNamed(m.step, m.metrics, "train"));
  (boot.evaluations || []).forEach((e) => addNamed(e.step, e.metrics, "eval"));
  const PALETTE = ["#2f9e44", "#ae3ec9", "#f08c00", "#1098ad", "#e03131", "#5c7cfa"];
  let metricsChart = null;
  function namedData() {
    const xs = [...new Set([...named.values()].flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
    return [xs, ...[...named.values()].map((m) => xs.map((x) => (m.has(x) ? m.get(x) : null)))];
  }
  function drawNamed(rebuild) {
    if (!named.size) return;
    $("#metrics-figure").hidden = false;
    const labels = [...named.keys()];
    if (metricsChart && !rebuild) { metricsChart.setData(namedData()); return; }
    if (metricsChart) metricsChart.destroy();
    const target = $("#metrics-chart");
    metricsChart = new uPlot({
      width: Math.max(280, target.clientWidth || 480), height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "step", stroke: css.getPropertyValue("--fg") },
        { stroke: css.getPropertyValue("--fg"), size: 56 }],
      series: [{ label: "step" }, ...labels.map((label, i) => ({
        label: label, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true,
        points: { show: label.endsWith("(eval)") },
      }))],
      legend: { show: true, live: false },
    }, namedData(), target);
  }
  drawNamed(true);
  window.addEventListener("resize", () => {
    [lossChart, speedChart, metricsChart].filter(Boolean).forEach((c) => c.setSize({ width: Math.max(280, c.root.parentElement.clientWidth), height: 220 }));
  });

  // --- facts, devices, resizes, log ---------------------------------------------------------
  function modeFacts() {
    if (job.consistency === "strict") {
      return [["Virtual workers", job.virtual_workers === null || job.virtual_workers === undefined ? "–" : String(job.virtual_workers)]];
    }
    return [
      ["Global batch", globalBatch()],
      ["Learning rate", job.learning_rate === null || job.learning_rate === undefined ? "–" : job.learning_rate.toPrecision(4)],
    ];
  }
  // Hybrid: the global batch of the last step and, where it differs, the scheduler's choice,
  // which the job's workers take up with its next generation.
  function globalBatch() {
    const last = job.global_batch, chosen = job.batch_size;
    if (!last) return chosen ? chosen + ", chosen by the scheduler (no step yet)" : "–";
    return chosen && chosen !== last ? last + " at the last step; the scheduler chose " + chosen + " for the next generation" : String(last);
  }
  const hasEnded = () => FINAL.includes(job.state);
  // How long the job ran: from its first start to its end; one that never started says how long
  // it waited instead.
  function ranFor() {
    const end = Date.parse(job.finished_at);
    if (job.started_at) return BungeeFormat.duration((end - Date.parse(job.started_at)) / 1000);
    return "never started (" + BungeeFormat.duration((end - Date.parse(job.created_at)) / 1000) + " queued)";
  }
  // A job that has ended: how it ended, how long it ran, its final numbers; nothing live.
  function endedFacts() {
    return [
      ["Owner", job.owner], ["Workload", job.workload],
      ["Mode", job.consistency + ", " + job.priority],
      ...modeFacts(),
      ["Ended", job.state + " at step " + job.steps_done + " of " + job.total_steps +
        (job.finished_at ? ", " + new Date(job.finished_at).toLocaleString() : "")],
      ["Ran for", job.finished_at ? ranFor() : "–"],
      ["Final loss", job.last_loss === null || job.last_loss === undefined ? "–" : job.last_loss.toFixed(4)],
      ["Last throughput", job.samples_per_s ? job.samples_per_s.toFixed(0) + " samples/s" : "–"],
    ];
  }
  function liveFacts() {
    const rows = [
      ["Owner", job.owner], ["Workload", job.workload],
      ["Mode", job.consistency + ", " + job.priority],
      ...modeFacts(),
      ["Workers", job.workers + " of " + job.min_workers + "–" + job.max_workers +
        (job.pinned_workers !== null && job.pinned_workers !== undefined ? " (pinned to " + job.pinned_workers + ")" : "")],
      ["Progress", job.steps_done + " / " + job.total_steps + " steps" + rollbackNote() +
        (job.state === "running" || job.state === "resizing" ? " (" + BungeeLive.progressText(job) + ")" : "")],
      ["Loss", job.last_loss === null || job.last_loss === undefined ? "–" : job.last_loss.toFixed(4)],
      ["Throughput", job.samples_per_s ? job.samples_per_s.toFixed(0) + " samples/s" : "–"],
      ["Generation", String(job.generation)],
      ["Scheduler", job.schedule_note || "–"],
    ];
    if (job.pin_problem) rows.push(["Pin not met", job.pin_problem]);
    if (job.state === "queued" && job.queue && job.queue.position) {
      rows.push(["Queue", BungeeLive.queueText(job)]);
      if (job.queue.holders.length) rows.push(["Waiting for", job.queue.holders.map(BungeeLive.holderText).join("; ")]);
    }
    return rows;
  }
  function renderFacts() {
    const facts = $("#facts");
    facts.replaceChildren();
    const ended = hasEnded();
    const rows = ended ? endedFacts() : liveFacts();
    markEmpty($("#loss-chart"));
    markEmpty($("#speed-chart"));
    rows.forEach(([k, v]) => facts.append(el("dt", k), el("dd", v)));
    const model = $("#download-model");
    if (job.artifacts) {
      const files = Object.fromEntries(job.artifacts.files.map((f) => [f.name, f]));
      model.href = files["model.pt"].url;
      model.hidden = false;
      const cell = el("dd");
      ["checkpoint.pt", "manifest.json"].forEach((name, i) => {
        if (i) cell.append(", ");
        cell.append(el("a", name, { href: files[name].url, download: "" }));
      });
      cell.append(" (step " + job.artifacts.step + ", " + job.artifacts.ended + ")");
      facts.append(el("dt", "Also kept"), cell);
      const metrics = (job.artifacts.final && job.artifacts.final.metrics) || {};
      const shown = Object.entries(metrics).map(([k, v]) => k + " " + Number(v).toPrecision(4)).join(", ");
      if (shown) facts.append(el("dt", "Final evaluation"), el("dd", shown));
    } else {
      model.hidden = true;
    }
    if (job.spec && job.spec.code) {
      const cell = el("dd");
      cell.append(el("a", "download (" + job.spec.code.slice(0, 12) + ")", { href: "/api/code/" + job.spec.code, id: "code-download" }));
      facts.append(el("dt", "Code"), cell);
    }
    const state = $("#job-state");
    state.textContent = job.state;
    state.className = "state state-" + job.state;
    $("#job-message").textContent = job.message || "";
    markEmptyLog();
    // The controls of a live job go when it ends (the page of an ended job has none).
    const controls = $("#live-controls");
    if (controls && ended) controls.remove();
    else if (controls) $("#unpin").hidden = job.pinned_workers === null || job.pinned_workers === undefined;
  }

  const deviceSamples = new Map();
  function renderDevices() {
    // The socket sends the samples of this job's devices only.
    BungeeLive.subscribeSamples({ device_ids: (job.allocations || []).map((a) => a.device_id).sort((a, b) => a - b) });
    const body = $("#job-devices tbody");
    body.replaceChildren();
    (job.allocations || []).forEach((a) => {
      const s = deviceSamples.get(a.device_id);
      let util = null, mem = 0;
      (s && s.processes || []).forEach((p) => {
        if (p.job_id !== job.id) return;
        if (p.utilization_pct !== null && p.utilization_pct !== undefined) util = (util || 0) + p.utilization_pct;
        mem += p.memory_bytes;
      });
      const row = el("tr");
      const device = el("td", a.node + "/" + a.device_index);
      if (a.backend === "simulated") device.append(" ", el("span", "simulated", { class: "sim" }));
      row.append(el("td", String(a.rank)), device,
        el("td", util === null ? "–" : util.toFixed(0) + "%"), el("td", s ? bytes(mem) : "–"),
        el("td", s ? s.utilization_pct.toFixed(0) + "%" : "–"));
      body.appendChild(row);
    });
    if (!(job.allocations || []).length) {
      const row = el("tr");
      row.appendChild(el("td", "no devices now", { colspan: "5", class: "table-empty" }));
      body.appendChild(row);
    }
  }

  function renderResizes() {
    const body = $("#resizes tbody");
    body.replaceChildren();
    (job.resizes || []).forEach((r) => {
      const row = el("tr");
      row.append(el("td", String(r.generation)), el("td", new Date(r.requested_at).toLocaleTimeString()),
        el("td", r.reason + (r.requested_by ? " (asked by " + r.requested_by + ")" : "")),
        el("td", r.workers_before + " → " + r.workers_after),
        el("td", r.pause_s === null || r.pause_s === undefined ? "–" : r.pause_s.toFixed(2) + " s"),
        el("td", r.land_s === null || r.land_s === undefined ? "–" : r.land_s.toFixed(1) + " s"),
        el("td", (r.devices_after || []).join(", ")),
        el("td", (r.members_after || []).length
          ? ((r.members_before || []).join(", ") || "none") + " → " + r.members_after.join(", ") : "–"),
        el("td", bytes(r.bytes_moved)),
        el("td", Object.entries(r.phases || {}).sort(([a], [b]) => phaseOrder(a) - phaseOrder(b))
          .map(([name, s]) => name.replace("_", " ") + " " + (s * 1000).toFixed(0) + " ms").join(", ") || "–"));
      body.appendChild(row);
    });
    if (!(job.resizes || []).length) {
      const row = el("tr");
      row.appendChild(el("td", hasEnded() ? "none: the job never had workers" : "no workers yet", { colspan: "10", class: "table-empty" }));
      body.appendChild(row);
    }
  }

  const log = $("#log");
  // An empty log says why it is empty (the CSS shows data-empty while the log has no line).
  function markEmptyLog() {
    log.dataset.empty = hasEnded() ? "no log lines: the job's workers wrote none" : "no log lines yet";
  }
  function appendLog(line) {
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.append(line + "\n");
    while (log.childNodes.length > MAX_LOG_LINES) log.removeChild(log.firstChild);
    if (atBottom) log.scrollTop = log.scrollHeight;
  }
  let lastLogId = 0;
  function addLog(entry) {
    if (entry.id <= lastLogId) return;
    lastLogId = entry.id;
    appendLog("[" + entry.generation + "." + entry.rank + "] " + entry.line);
  }
  boot.logs.forEach(addLog);
  markEmptyLog();

  async function refresh() {
    const reply = await fetch("/api/jobs/" + job.id, { credentials: "same-origin" });
    if (reply.ok) {
      job = await reply.json(); renderFacts(); renderDevices(); renderResizes();
      [lossChart, speedChart].forEach((u) => { if (u) placeResizeMarkers(u); });
    }
  }

  async function catchUpLogs() {
    const reply = await fetch("/api/jobs/" + job.id + "/logs?after=" + lastLogId, { credentials: "same-origin" });
    if (reply.ok) (await reply.json()).forEach(addLog);
  }

  // --- actions -------------------------------------------------------------------------------
  function say(text) {
    const box = $("#action-message");
    box.textContent = text;
    box.hidden = !text;
  }
  const onClick = (sel, handler) => { const button = $(sel); if (button) button.addEventListener("click", handler); };
  onClick("#resize", async () => {
    const raw = $("#resize-to").value.trim();
    const workers = raw === "" ? null : Number(raw);
    const result = await BungeeLive.post("/api/jobs/" + job.id + "/resize", { workers: workers });
    say(result.ok ? (workers === null ? "Pin lifted: the scheduler decides." : "Resizing to " + BungeeFormat.counted(workers, "worker") + "…") : BungeeLive.errorText(result));
    if (result.ok) { job = result.body; renderFacts(); }
  });
  onClick("#unpin", async () => {
    const result = await BungeeLive.post("/api/jobs/" + job.id + "/unpin");
    say(result.ok ? "Pin lifted: the scheduler decides." : BungeeLive.errorText(result));
    if (result.ok) { job = result.body; $("#resize-to").value = ""; renderFacts(); }
  });
  onClick("#cancel", async () => {
    if (!confirm("Cancel job " + job.name + "? Its workers stop and its devices are freed.")) return;
    const result = await BungeeLive.post("/api/jobs/" + job.id + "/cancel");
    say(result.ok ? "Cancelled." : BungeeLive.errorText(result));
    if (result.ok) { job = result.body; renderFacts(); renderDevices(); }
  });

  BungeeLive.on((msg) => {
    if (msg.type === "progress" && msg.job_id === job.id) {
      addPoint(msg);
      job.steps_done = msg.step; job.last_loss = msg.loss; job.samples_per_s = msg.samples_per_s;
      job.finish_estimate_at = msg.finish_estimate_at;
      if (msg.global_batch) job.global_batch = msg.global_batch;
      if (msg.learning_rate !== null && msg.learning_rate !== undefined) job.learning_rate = msg.learning_rate;
      renderFacts();
      drawNamed(addNamed(msg.step, msg.metrics, "train"));
    } else if (msg.type === "evaluation" && msg.job_id === job.id) {
      drawNamed(addNamed(msg.step, msg.metrics, "eval"));
    } else if (msg.type === "log" && msg.job_id === job.id) {
      addLog(msg);
    } else if (msg.type === "job_state" && msg.job.id === job.id) {
      refresh();
    } else if (msg.type === "subscribed" && msg.job_id === job.id) {
      // After (re)subscribing, whatever happened while the socket was away is fetched once.
      refresh();
      catchUpLogs();
      reloadCurve();
    } else if (msg.type === "samples") {
      BungeeLive.sampleRows(msg).forEach((s) => deviceSamples.set(s.device_id, BungeeLive.mergeSample(deviceSamples.get(s.device_id), s)));
      renderDevices();
    }
  });
  BungeeLive.subscribeJob(job.id);
  setInterval(() => { if (job.finish_estimate_at || (job.queue && job.queue.start_estimate_at)) renderFacts(); }, 5000);
  renderFacts(); renderDevices(); renderResizes();
})();
