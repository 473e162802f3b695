// The cluster board: every device with its live readings, and every active job as a bar whose
// length is its worker count. A job's owner (or staff) drags the bar's right edge, or focuses
// the bar and uses the arrow keys and Enter, to resize it; a size outside [min, max] or beyond
// the free devices snaps back with the reason. Everything arrives over the live socket.
(function () {
  "use strict";
  const boot = BungeeLive.bootstrap();
  const viewer = boot.viewer;
  const devices = new Map();
  const jobs = new Map();
  const pending = new Map();
  const HISTORY_S = 300;
  const FINAL = new Set(["succeeded", "failed", "cancelled"]);

  const $ = (sel, root) => (root || document).querySelector(sel);
  const el = (tag, attrs, text) => {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => node.setAttribute(k, v));
    if (text !== undefined) node.textContent = text;
    return node;
  };
  const counted = BungeeFormat.counted;
  const bytes = (n) => {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return n.toFixed(n >= 10 || i === 0 ? 0 : 1) + " " + units[i];
  };
  const mayManage = (job) => viewer.is_staff || job.owner === viewer.username;

  function holderOf(device) {
    if (device.holder === "lost" || device.holder === "drained") return device.holder;
    if (device.sample && device.sample.owner_present) return "owner";
    return device.job ? "job" : (device.holder === "owner" ? "owner" : "free");
  }

  // --- nodes ---------------------------------------------------------------------------------
  // A node whose agent is silent says for how long, and what happens next: its workers train on
  // until the portal gives up on the agent (unreachable_timeout_s), then the node is lost.
  const nodes = new Map();
  let unreachableTimeoutS = null;

  const duration = BungeeFormat.duration;

  const since = (iso) => duration((Date.now() - Date.parse(iso)) / 1000);

  function renderNodeNotes() {
    const list = $("#node-notes");
    const silent = [...nodes.values()].filter((n) => n.state !== "online");
    list.replaceChildren(...silent.map((n) => {
      const limit = unreachableTimeoutS === null ? "" : "; the node is lost after " + duration(unreachableTimeoutS) + " of silence";
      const left = n.drain_deadline_at ? (Date.parse(n.drain_deadline_at) - Date.now()) / 1000 : null;
      const text = {
        unreachable: n.name + ": agent unreachable for " + since(n.last_seen_at) + " — its workers train on" + limit,
        draining: n.name + ": draining (" + n.drain_cause + ") — its jobs move off it" +
          (left === null ? "" : left > 0 ? "; its devices leave in " + duration(left) : "; its deadline has passed"),
        drained: n.name + ": drained (" + n.drain_cause + ") — its agent left",
        lost: n.name + ": lost, silent for " + since(n.last_seen_at) + " — its workers were planned out",
      }[n.state] || n.name + ": " + n.state;
      return el("li", { class: "node-note node-" + n.state, "data-node": n.name }, text);
    }));
    list.hidden = silent.length === 0;
  }
  setInterval(() => { if (!$("#node-notes").hidden) renderNodeNotes(); }, 1000);

  // --- devices -------------------------------------------------------------------------------
  function loadCluster(cluster) {
    if (cluster.unreachable_timeout_s !== undefined) unreachableTimeoutS = cluster.unreachable_timeout_s;
    nodes.clear();
    cluster.nodes.forEach((node) => nodes.set(node.name, {
      name: node.name, state: node.state, last_seen_at: node.last_seen_at,
      drain_cause: node.drain_cause, drain_deadline_at: node.drain_deadline_at }));
    renderNodeNotes();
    const seen = new Set();
    cluster.nodes.forEach((node) => node.devices.forEach((d) => {
      const old = devices.get(d.id);
      devices.set(d.id, Object.assign({}, d, { node: node.name, nodeState: node.state,
        simulated: node.backend === "simulated", history: old ? old.history : [] }));
      if (d.sample) pushHistory(devices.get(d.id), d.sample);
      seen.add(d.id);
    }));
    [...devices.keys()].forEach((id) => { if (!seen.has(id)) devices.delete(id); });
    // The active jobs as of this snapshot, taken after the socket joined its groups: what the
    // page missed before (its render, a reconnect) is here, and every later change comes as a
    // message. A job not in it is no longer active.
    if (cluster.jobs) {
      const active = new Map(cluster.jobs.map((job) => [job.id, job]));
      [...jobs.keys()].forEach((id) => { if (!active.has(id)) { jobs.delete(id); pending.delete(id); } });
      active.forEach((job, id) => {
        jobs.set(id, job);
        if (pending.has(id) && job.workers === pending.get(id) && job.state === "running") pending.delete(id);
      });
    }
    renderDevices();
    redrawLive();
  }

  function pushHistory(device, sample) {
    const h = device.history;
    if (!h.length || h[h.length - 1][0] < sample.taken_at) h.push([sample.taken_at, sample.utilization_pct]);
    const cutoff = sample.taken_at - HISTORY_S;
    while (h.length && h[0][0] < cutoff) h.shift();
  }

  function sparkline(history) {
    const w = 120, h = 24;
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.setAttribute("class", "spark");
    svg.setAttribute("aria-hidden", "true");
    if (history.length > 1) {
      // The x axis spans what there is, up to HISTORY_S: a fresh page still draws a line.
      const last = history[history.length - 1][0];
      const span = Math.max(10, Math.min(HISTORY_S, last - history[0][0]));
      const t0 = last - span;
      const points = history.filter(([t]) => t >= t0).map(([t, u]) =>
        ((t - t0) / span * w).toFixed(1) + "," + (h - 1 - (u / 100) * (h - 2)).toFixed(1));
      const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
      line.setAttribute("points", points.join(" "));
      svg.appendChild(line);
    }
    return svg;
  }

  function perJob(sample) {
    if (!sample || !sample.processes) return "";
    const shares = new Map();
    sample.processes.forEach((p) => {
      if (p.job_id === null || p.job_id === undefined) return;
      const s = shares.get(p.job_id) || { util: 0, mem: 0, known: false };
      if (p.utilization_pct !== null && p.utilization_pct !== undefined) { s.util += p.utilization_pct; s.known = true; }
      s.mem += p.memory_bytes;
      shares.set(p.job_id, s);
    });
    const parts = [...shares.entries()].map(([id, s]) =>
      "#" + id + ": " + (s.known ? s.util.toFixed(0) + "%" : "–") + " · " + bytes(s.mem));
    const standby = standbyBytes(sample);
    if (standby !== null) parts.push("warm standby · " + bytes(standby));
    return parts.join("; ");
  }

  // The memory of the warm standby the agent keeps on a free device (a worker process of the
  // agent's that no job has yet), or null if it keeps none there.
  function standbyBytes(sample) {
    const standbys = ((sample && sample.processes) || []).filter((p) => p.ours && (p.job_id === null || p.job_id === undefined));
    return standbys.length ? standbys.reduce((sum, p) => sum + p.memory_bytes, 0) : null;
  }
  const STANDBY_NOTE = " held by a warm standby: a worker the agent keeps started on this free device, so that a job " +
    "growing here starts in well under a second. It gives the device up as soon as a job or the device's owner needs it.";

  function renderDevices() {
    const body = $("#devices tbody");
    const headings = [...document.querySelectorAll("#devices thead th")].map((th) => th.textContent);
    body.replaceChildren();
    // The rows on screen are forgotten until the next frame reports the new ones (which sets
    // the timer again): a subscription still waiting would go out for none of them.
    rowsOnScreen.disconnect();
    shownRows.clear();
    clearTimeout(subscribeTimer);
    [...devices.values()].forEach((d) => {
      const row = el("tr", { "data-device": d.id });
      row.appendChild(el("th", { scope: "row" }, d.node + "/" + d.index));
      const util = el("td", { class: "util" });
      util.append(el("span", { "data-field": "util" }), sparkline(d.history));
      row.appendChild(util);
      row.appendChild(el("td", { "data-field": "mem" }));
      row.appendChild(el("td", { "data-field": "temp" }));
      row.appendChild(el("td", { "data-field": "power" }));
      row.appendChild(el("td", { "data-field": "holder" }));
      row.appendChild(el("td", { "data-field": "share" }));
      // Each cell names its column, for the narrow layout that stacks a row's cells.
      row.querySelectorAll("td").forEach((cell, i) => cell.setAttribute("data-label", headings[i + 1]));
      body.appendChild(row);
      updateDeviceRow(d);
      rowsOnScreen.observe(row);
    });
    summarise();
  }

  // The socket sends the samples of the nodes whose rows are on screen (or near it); the rest
  // keep their last readings until they are scrolled to.
  const shownRows = new Set();
  let subscribeTimer = null;
  const rowsOnScreen = new IntersectionObserver((entries) => {
    entries.forEach((entry) => {
      const id = Number(entry.target.dataset.device);
      if (entry.isIntersecting) shownRows.add(id); else shownRows.delete(id);
    });
    clearTimeout(subscribeTimer);
    subscribeTimer = setTimeout(subscribeShownNodes, 100);
  }, { rootMargin: "200px 0px" });

  function subscribeShownNodes() {
    [...shownRows].forEach((id) => { if (!devices.has(id)) shownRows.delete(id); });
    const shown = new Set([...shownRows].map((id) => devices.get(id).node));
    const all = new Set([...devices.values()].map((d) => d.node));
    BungeeLive.subscribeSamples(shown.size === all.size ? { all: true } : { nodes: [...shown].sort() });
  }

  function updateDeviceRow(d) {
    const row = $('#devices tr[data-device="' + d.id + '"]');
    if (!row) return;
    const s = d.sample;
    $('[data-field="util"]', row).textContent = s ? s.utilization_pct.toFixed(0) + "%" : "–";
    const spark = $(".spark", row);
    if (spark) spark.replaceWith(sparkline(d.history));
    $('[data-field="mem"]', row).textContent = s ? bytes(s.memory_used_bytes) + " / " + bytes(s.memory_total_bytes) : "–";
    reading($('[data-field="temp"]', row), s && s.temperature_c !== null ? s.temperature_c.toFixed(0) + " °C" : null, d.simulated);
    reading($('[data-field="power"]', row), s && s.power_w !== null ? s.power_w.toFixed(0) + " W" : null, d.simulated);
    const holder = $('[data-field="holder"]', row);
    const kind = holderOf(d);
    holder.replaceChildren();
    if (kind === "job" && d.job) {
      const tag = el("span", { class: "tag job-tag", style: BungeeFormat.jobColour(d.job.id) },
        "#" + d.job.id + " " + d.job.name + " (" + d.job.owner + ")");
      holder.appendChild(tag);
    } else {
      holder.appendChild(el("span", { class: "tag tag-" + kind }, { free: "free", owner: "its owner", lost: "lost", drained: "drained" }[kind] || kind));
    }
    // A free device's memory in use is its warm standby's: said where the memory is shown.
    const standby = kind === "free" ? standbyBytes(s) : null;
    const mem = $('[data-field="mem"]', row);
    if (standby !== null) {
      const note = bytes(standby) + STANDBY_NOTE;
      mem.title = note;
      holder.append(" ", el("span", { class: "standby", title: note }, "warm standby"));
    } else {
      mem.removeAttribute("title");
    }
    $('[data-field="share"]', row).textContent = perJob(s);
  }

  // A reading that the simulated backend models rather than measures (a CPU slot's temperature
  // and power) says so.
  function reading(cell, text, simulated) {
    cell.textContent = text === null ? "–" : text;
    if (text !== null && simulated) cell.append(" ", el("span", { class: "sim" }, "simulated"));
  }

  function summarise() {
    const all = [...devices.values()];
    const free = all.filter((d) => holderOf(d) === "free").length;
    const nodes = new Set(all.map((d) => d.node)).size;
    $("#board-summary").textContent = counted(nodes, "node") + " · " + counted(all.length, "device") + " · " + free +
      " free · " + counted([...jobs.values()].filter((j) => !FINAL.has(j.state)).length, "active job");
    $("#simulated-note").hidden = !all.some((d) => d.simulated);
  }

  // --- jobs lane -----------------------------------------------------------------------------
  const freeDevices = () => [...devices.values()].filter((d) => holderOf(d) === "free").length;
  // A job's track has a cell for each worker it may have: a full bar is a job at its most.
  const trackSize = (job) => Math.max(1, job.max_workers);

  function message(text) {
    const box = $("#board-message");
    box.textContent = text;
    box.hidden = !text;
  }

  // The lane is redrawn row by row: a row whose job (but for its progress, which is updated in
  // place), draft, size of track and rights are what they were when it was drawn stays the same
  // element, so that a live update of one job leaves the others' controls alone (a click being
  // made on one, a focused bar, a keyboard draft). A row drawn over by a draft is marked stale.
  function rowKey(job) {
    const shown = Object.assign({}, job);
    delete shown.steps_done;
    delete shown.progress;
    delete shown.finish_estimate_at;
    return JSON.stringify([shown, pending.has(job.id) ? pending.get(job.id) : null, mayManage(job)]);
  }

  const drawnAs = new WeakMap(); // row -> its rowKey when drawn

  function renderJobs() {
    const lane = $("#jobs-lane");
    const active = [...jobs.values()].filter((j) => !FINAL.has(j.state));
    const drawn = new Map([...lane.querySelectorAll(":scope > .job-row")].map((row) => [Number(row.dataset.job), row]));
    const rows = active.map((job) => {
      const key = rowKey(job);
      const kept = drawn.get(job.id);
      if (kept && drawnAs.get(kept) === key) return kept;
      const row = jobRow(job, trackSize(job));
      drawnAs.set(row, key);
      return row;
    });
    if (!rows.length) rows.push(el("p", { class: "muted" }, "No active jobs. Submit one from the Submit page."));
    // In order, moving only what moved: a kept row in its place is not touched.
    rows.forEach((row, i) => { if (lane.children[i] !== row) lane.insertBefore(row, lane.children[i] || null); });
    while (lane.children.length > rows.length) lane.lastElementChild.remove();
    updateStanding();
    summarise();
  }

  function jobRow(job, cells) {
    const row = el("div", { class: "job-row", "data-job": job.id });
    const label = el("div", { class: "job-label" });
    const title = mayManage(job) ? el("a", { href: "/jobs/" + job.id + "/" }, "#" + job.id + " " + job.name)
      : el("span", {}, "#" + job.id + " " + job.name);
    label.append(title, el("span", { class: "muted" }, " " + job.owner + " · " + job.state +
      " · " + job.workers + " of " + job.min_workers + "–" + job.max_workers));
    label.appendChild(el("div", { class: "progress", "data-field": "progress" }, standing(job)));
    label.appendChild(why(job));
    const track = el("div", { class: "track", style: "--cells:" + cells });
    const target = pending.has(job.id) ? pending.get(job.id) : job.workers;
    // A job without workers (queued) has no bar, only its state where the bar would start.
    const empty = job.workers === 0 && !pending.has(job.id);
    const bar = el("div", {
      class: "bar" + (pending.has(job.id) || job.state === "resizing" ? " resizing" : "") + (mayManage(job) ? " mine" : "") + (empty ? " empty" : ""),
      style: BungeeFormat.jobColour(job.id) + ";--workers:" + Math.max(job.workers, 0.25),
      tabindex: "0",
      "data-workers": job.workers,
      "aria-label": "Job " + job.name + " workers",
    });
    if (mayManage(job)) {
      bar.setAttribute("role", "slider");
      bar.setAttribute("aria-valuemin", "0");
      bar.setAttribute("aria-valuemax", String(cells));
      bar.setAttribute("aria-valuenow", String(target));
      bar.setAttribute("aria-valuetext", counted(target, "worker"));
      const handle = el("span", { class: "handle", "aria-hidden": "true" });
      bar.appendChild(handle);
      attachDrag(job, bar, handle, track);
      attachKeys(job, bar, track);
    } else {
      bar.setAttribute("role", "img");
      bar.setAttribute("aria-label", "Job " + job.name + " of " + job.owner + ": " + counted(job.workers, "worker") + " (not yours to resize)");
    }
    bar.appendChild(el("span", { class: "bar-text" }, pending.has(job.id) ? "resizing to " + target + "…"
      : empty ? (job.state === "queued" ? "queued: no workers yet" : "no workers") : counted(job.workers, "worker")));
    track.appendChild(bar);
    row.append(label, track);
    return row;
  }

  // Where the job stands: a running job's progress and ETA; a queued job's place, its estimated
  // start and the jobs it waits for.
  function standing(job) {
    if (job.state === "queued") {
      const holders = ((job.queue && job.queue.holders) || []).map(BungeeLive.holderText);
      return BungeeLive.queueText(job) + (holders.length ? " · waits for " + holders.join(", ") : "");
    }
    return BungeeLive.progressText(job);
  }

  function updateStanding() {
    document.querySelectorAll(".job-row").forEach((row) => {
      const job = jobs.get(Number(row.dataset.job));
      const cell = row.querySelector('[data-field="progress"]');
      if (job && cell) cell.textContent = standing(job);
    });
  }
  setInterval(updateStanding, 5000);

  // Why the job has what it has (the scheduler's reasons), an unmet pin, and the control that
  // lifts a pin, for those who may manage the job.
  function why(job) {
    const box = el("div", { class: "why", "data-field": "why" });
    const pinned = job.pinned_workers !== null && job.pinned_workers !== undefined;
    const note = job.schedule_note || (job.state === "queued" ? "waiting for the scheduler" : "");
    if (note) box.appendChild(el("span", { class: "reason" }, note));
    (job.schedule_reasons || []).forEach((r) => box.setAttribute("data-" + r.replace(/[^a-z]+/g, "-"), ""));
    if (job.pin_problem) box.appendChild(el("span", { class: "pin-problem", role: "status" }, "Pin not met: " + job.pin_problem));
    if (pinned && mayManage(job)) {
      const lift = el("button", { type: "button", class: "quiet unpin", "aria-label": "Lift the pin of job " + job.name }, "Lift pin");
      lift.addEventListener("click", async () => {
        const result = await BungeeLive.post("/api/jobs/" + job.id + "/unpin");
        message(result.ok ? "" : "Could not lift the pin: " + BungeeLive.errorText(result));
        if (result.ok) { jobs.set(job.id, Object.assign({}, job, { pinned_workers: null, pin_problem: "" })); renderJobs(); }
      });
      box.appendChild(lift);
    }
    return box;
  }

  function showDraft(bar, track, draft) {
    drawnAs.delete(bar.closest(".job-row")); // drawn over: the next redraw replaces it
    bar.style.setProperty("--workers", Math.max(draft, 0.25));
    bar.classList.remove("empty");
    bar.querySelector(".bar-text").textContent = "→ " + counted(draft, "worker");
    bar.setAttribute("aria-valuenow", String(draft));
    bar.setAttribute("aria-valuetext", counted(draft, "worker"));
    track.classList.add("dragging");
  }

  async function commit(job, draft) {
    message("");
    if (draft === job.workers && !pending.has(job.id)) { renderJobs(); return; }
    let refusal = "";
    if (draft < job.min_workers || draft > job.max_workers) {
      refusal = job.name + " must have between " + job.min_workers + " and " + job.max_workers + " workers; " + draft + " is outside that.";
    } else if (draft > job.workers + freeDevices()) {
      refusal = "Only " + counted(freeDevices(), "device") + (freeDevices() === 1 ? " is" : " are") + " free: " + job.name +
        " can have at most " + counted(job.workers + freeDevices(), "worker") + " now.";
    }
    if (refusal) { message(refusal); renderJobs(); return; }
    pending.set(job.id, draft);
    renderJobs();
    const result = await BungeeLive.post("/api/jobs/" + job.id + "/resize", { workers: draft });
    if (!result.ok) {
      pending.delete(job.id);
      message("Resize refused: " + BungeeLive.errorText(result));
      renderJobs();
    }
  }

  function attachDrag(job, bar, handle, track) {
    let dragging = false;
    let draft = job.workers;
    const cellWidth = () => track.getBoundingClientRect().width / trackSize(job);
    handle.addEventListener("pointerdown", (event) => {
      dragging = true;
      draft = job.workers;
      handle.setPointerCapture(event.pointerId);
      // From the press on, live updates wait (renderJobs would replace the handle under the
      // pointer and drop the drag before its first move).
      track.classList.add("dragging");
      event.preventDefault();
    });
    handle.addEventListener("pointermove", (event) => {
      if (!dragging) return;
      const x = event.clientX - track.getBoundingClientRect().left;
      draft = Math.max(0, Math.min(trackSize(job), Math.round(x / cellWidth())));
      showDraft(bar, track, draft);
    });
    const end = () => { if (dragging) { dragging = false; commit(job, draft); } };
    handle.addEventListener("pointerup", end);
    handle.addEventListener("pointercancel", () => { dragging = false; renderJobs(); });
  }

  function attachKeys(job, bar, track) {
    let draft = null;
    bar.addEventListener("keydown", (event) => {
      const current = draft === null ? job.workers : draft;
      if (event.key === "ArrowRight" || event.key === "ArrowUp") draft = Math.min(trackSize(job), current + 1);
      else if (event.key === "ArrowLeft" || event.key === "ArrowDown") draft = Math.max(0, current - 1);
      else if (event.key === "Enter" && draft !== null) { const d = draft; draft = null; commit(job, d).then(() => focusBar(job.id)); return; }
      else if (event.key === "Escape") { draft = null; renderJobs(); focusBar(job.id); return; }
      else return;
      event.preventDefault();
      showDraft(bar, track, draft);
    });
  }

  function focusBar(id) {
    const bar = $('.job-row[data-job="' + id + '"] .bar');
    if (bar) bar.focus();
  }

  // A press on a job row's button or link holds the redraws of live job updates until it is
  // released, as a drag does: a redraw of that job's row between the press and the release
  // replaced the control, and the browser sent its click to neither (a lifted pin was lost that
  // way in CI). The held redraw runs after the click has been handled. A press ends only with its
  // release (or the page losing the pointer or the focus): a time limit ended a slow user's press,
  // and a slow portal's update came after it (a CI run lost the click that way).
  let pressed = false;
  let missed = false;
  $("#jobs-lane").addEventListener("pointerdown", (event) => {
    if (event.button === 0 && event.target.closest("button, a")) pressed = true;
  });
  function release() {
    if (!pressed) return;
    pressed = false;
    if (missed) setTimeout(redrawLive, 0);
  }
  document.addEventListener("pointerup", release, true);
  document.addEventListener("pointercancel", release, true);
  window.addEventListener("blur", release);

  // A redraw that live news asks for: held while a control is pressed or a bar dragged (the drag's
  // end redraws). The focus stays where it was: on a kept row it is not touched, and a row drawn
  // anew gets it on the same control (its link, a button, the bar), so a keyboard user's Tab goes
  // on from there (moving it to the bar skipped the controls between; a CI run saw that).
  const CONTROLS = "a[href], button, [tabindex]:not([tabindex='-1'])";
  function redrawLive() {
    missed = false;
    if (pressed || document.querySelector(".track.dragging")) {
      missed = pressed;
      return;
    }
    const active = document.activeElement;
    const row = active && active.closest(".job-row");
    const at = row ? [...row.querySelectorAll(CONTROLS)].indexOf(active) : -1;
    renderJobs();
    if (!row || row.isConnected) return;
    const fresh = $('.job-row[data-job="' + row.dataset.job + '"]');
    if (!fresh) return;
    const control = [...fresh.querySelectorAll(CONTROLS)][at] || fresh.querySelector(".bar");
    if (control) control.focus();
  }

  // --- live ----------------------------------------------------------------------------------
  BungeeLive.on(function (msg) {
    if (msg.type === "cluster") {
      loadCluster(msg.cluster);
    } else if (msg.type === "samples") {
      BungeeLive.sampleRows(msg).forEach((s) => {
        const d = devices.get(s.device_id);
        if (!d) return;
        d.sample = BungeeLive.mergeSample(d.sample, s);
        pushHistory(d, d.sample);
        updateDeviceRow(d);
      });
      summarise();
    } else if (msg.type === "allocations") {
      const byDevice = new Map(msg.allocations.map((a) => [a.device_id, a]));
      devices.forEach((d) => {
        const a = byDevice.get(d.id);
        const job = a ? jobs.get(a.job_id) : null;
        d.job = a ? { id: a.job_id, rank: a.rank, name: job ? job.name : "job " + a.job_id, owner: job ? job.owner : "" } : null;
        updateDeviceRow(d);
      });
      summarise();
    } else if (msg.type === "job" || msg.type === "jobs") {
      // A scheduling cycle's changes come as one `jobs` message, drawn once.
      (msg.type === "job" ? [msg.job] : msg.jobs).forEach((job) => {
        jobs.set(job.id, job);
        if (pending.has(job.id) && job.workers === pending.get(job.id) && job.state === "running") pending.delete(job.id);
        if (FINAL.has(job.state)) pending.delete(job.id);
      });
      redrawLive();
    } else if (msg.type === "node") {
      nodes.set(msg.name, { name: msg.name, state: msg.state, last_seen_at: msg.last_seen_at,
        drain_cause: msg.drain_cause, drain_deadline_at: msg.drain_deadline_at });
      renderNodeNotes();
      devices.forEach((d) => {
        if (d.node !== msg.name) return;
        d.nodeState = msg.state;
        if (msg.state === "drained" || msg.state === "lost") d.holder = msg.state;
        else if (d.holder === "drained" || d.holder === "lost") d.holder = "free";
        updateDeviceRow(d);
      });
      summarise();
    } else if (msg.type === "job_progress") {
      const job = jobs.get(msg.job_id);
      if (job) {
        job.steps_done = msg.steps_done;
        job.finish_estimate_at = msg.finish_estimate_at;
        updateStanding();
      }
    }
  });

  // The cluster as of the page's render: devices, their bars' track and the jobs are drawn at
  // once; the socket's snapshot then changes only what changed since.
  loadCluster(boot.cluster);

  fetch("/api/cluster/history?minutes=5", { credentials: "same-origin" }).then((r) => r.ok ? r.json() : {}).then((history) => {
    Object.entries(history).forEach(([id, rows]) => {
      const d = devices.get(Number(id));
      if (!d) return;
      const live = d.history;
      d.history = rows.map((r) => [r[0], r[1]]).filter((r) => !live.length || r[0] < live[0][0]).concat(live);
      updateDeviceRow(d);
    });
  });
})();
