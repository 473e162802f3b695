// The one live socket of every page. Reconnects by itself with backoff, shows its state in the
// header ("live" once the socket is open, its snapshot of the cluster is in the page, and every
// job the page follows is subscribed, so that the page is current and no event of theirs can be
// missed from then on), re-subscribes after a reconnect, and hands each message to the page's
// handlers. While the portal's Redis or database is away it closes the socket with 1013, "try
// again later" (portal/live/unavailable.py); the page then says the portal is unavailable and
// waits at least what the API's 503 asks (Retry-After, 5 s) before it tries again. A
// page that shows only some devices says which (subscribeSamples), and the portal sends it only
// those devices' samples; a sample message holds, per device, only what changed since the
// device's previous one (sampleRows and mergeSample put a device's sample together again).
// A socket that fell too far behind is closed with 4429 (portal/live/consumers.py); it
// reconnects as after any close, and its snapshot is whole.
(function () {
  "use strict";
  const handlers = [];
  const jobSubscriptions = new Set();
  const unconfirmed = new Set();  // jobs asked for on this socket and not yet confirmed
  let sampleSubscription = null;
  let sentSampleSubscription = null;
  let socket = null;
  let caughtUp = false;  // this socket's snapshot (its first message) has been handed to the page
  let attempt = 0;  // sockets in a row that closed before their snapshot was in
  const TRY_AGAIN_LATER = 1013;
  const UNAVAILABLE_WAIT_MS = 5000;  // the API's Retry-After (portal/error_pages.py RETRY_AFTER_S)
  const stateEl = () => document.getElementById("conn-state");

  function showState(state, text) {
    const el = stateEl();
    if (!el) return;
    el.dataset.state = state;
    el.textContent = text;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(scheme + "://" + location.host + "/ws/live/");
    showState("connecting", attempt ? "reconnecting…" : "connecting…");
    socket.addEventListener("open", function () {
      caughtUp = false;
      unconfirmed.clear();
      jobSubscriptions.forEach(subscribe);
      showLive();
      sentSampleSubscription = null;
      sendSampleSubscription();
    });
    socket.addEventListener("message", function (event) {
      let message;
      try { message = JSON.parse(event.data); } catch (err) { return; }
      handlers.forEach((handler) => handler(message));
      if (message.type === "cluster") {
        attempt = 0;  // not at "open": a socket the portal accepts only to close (1013) backs off too
        caughtUp = true;
        showLive();
      } else if ((message.type === "subscribed" || message.type === "error") && unconfirmed.delete(message.job_id)) {
        showLive();
      }
    });
    socket.addEventListener("close", function (event) {
      attempt += 1;
      const backoff = Math.min(10000, 250 * 2 ** Math.min(attempt, 6));
      const unavailable = event.code === TRY_AGAIN_LATER;
      const delay = unavailable ? Math.max(UNAVAILABLE_WAIT_MS, backoff) : backoff;
      const said = unavailable ? "portal unavailable" : "offline";
      showState("offline", said + " — retrying in " + Math.round(delay / 1000) + " s");
      setTimeout(connect, delay);
    });
  }

  function showLive() {
    if (!socket || socket.readyState !== WebSocket.OPEN) return;
    if (!caughtUp) showState("connecting", "catching up…");
    else if (unconfirmed.size) showState("subscribing", "subscribing…");
    else showState("live", "live");
  }

  function subscribe(id) {
    unconfirmed.add(id);
    send({ action: "subscribe_job", job_id: id });
  }

  function send(message) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(message));
  }

  function sendSampleSubscription() {
    if (sampleSubscription === null || !socket || socket.readyState !== WebSocket.OPEN) return;
    const text = JSON.stringify(sampleSubscription);
    if (text === sentSampleSubscription) return;
    sentSampleSubscription = text;
    send(Object.assign({ action: "subscribe_samples" }, sampleSubscription));
  }

  // Which samples this page wants: {all: true}, or {nodes: [names], device_ids: [ids]}.
  function subscribeSamples(what) {
    sampleSubscription = what.all ? { all: true } : { nodes: what.nodes || [], device_ids: what.device_ids || [] };
    sendSampleSubscription();
  }

  // A samples message's rows, each with its taken_at (a message whose rows were all taken at
  // once says it once, beside them).
  function sampleRows(message) {
    if (message.taken_at === undefined) return message.samples;
    return message.samples.map((row) => row.taken_at === undefined ? Object.assign({ taken_at: message.taken_at }, row) : row);
  }

  // A device's sample after a message's row for it: the row's fields over the ones held.
  function mergeSample(held, row) {
    return Object.assign({}, held || {}, row);
  }

  function csrfToken() {
    const match = document.cookie.match(/(?:^|; )csrftoken=([^;]+)/);
    if (match) return decodeURIComponent(match[1]);
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  // POST JSON to the API with the session's CSRF token; resolves to {ok, status, body}.
  async function post(path, body) {
    const reply = await fetch(path, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify(body || {}),
    });
    let data = null;
    try { data = await reply.json(); } catch (err) { data = null; }
    return { ok: reply.ok, status: reply.status, body: data };
  }

  function errorText(result) {
    if (result.body && result.body.error) return result.body.error.message;
    return "the portal answered " + result.status;
  }

  // Times the scheduler estimates, for people: "about 3 min" from a Unix time.
  function about(unixSeconds) {
    const s = Math.max(0, unixSeconds - Date.now() / 1000);
    if (s < 60) return "about " + Math.max(5, Math.round(s / 5) * 5) + " s";
    if (s < 3600) return "about " + Math.round(s / 60) + " min";
    if (s < 86400 * 2) return "about " + (s / 3600).toFixed(1).replace(/\.0$/, "") + " h";
    return "about " + Math.round(s / 86400) + " days";
  }
  const ORDINAL = (n) => n + (n % 100 >= 11 && n % 100 <= 13 ? "th" : ["th", "st", "nd", "rd"][n % 10] || "th");

  // A running job's progress: "42% · about 3 min left".
  function progressText(job) {
    if (!job.total_steps) return "";
    const percent = Math.floor((100 * job.steps_done) / job.total_steps) + "%";
    return job.finish_estimate_at ? percent + " · " + about(job.finish_estimate_at) + " left" : percent;
  }

  // A queued job's place: "1st of 2 in the queue · starts in about 25 s".
  function queueText(job) {
    const q = job.queue;
    if (!q || !q.position) return "";
    const start = q.start_estimate_at ? "starts in " + about(q.start_estimate_at) : "no start estimate: " + q.no_estimate;
    return ORDINAL(q.position) + " of " + q.waiting + " in the queue · " + start;
  }

  // The jobs holding what a queued job waits for: "#4 hog (alice, 4 devices, pinned, ends in about 25 s)".
  function holderText(h) {
    const parts = [h.owner, BungeeFormat.counted(h.devices, "device")];
    if (h.pinned) parts.push("pinned");
    parts.push(h.finish_estimate_at ? "ends in " + about(h.finish_estimate_at) : "end not known yet");
    return "#" + h.id + " " + h.name + " (" + parts.join(", ") + ")";
  }

  window.BungeeLive = {
    about: about,
    progressText: progressText,
    queueText: queueText,
    holderText: holderText,
    on: (handler) => handlers.push(handler),
    subscribeJob: (id) => { jobSubscriptions.add(id); subscribe(id); showLive(); },
    subscribeSamples: subscribeSamples,
    sampleRows: sampleRows,
    mergeSample: mergeSample,
    post: post,
    errorText: errorText,
    bootstrap: () => JSON.parse(document.getElementById("bootstrap").textContent),
  };
  document.addEventListener("DOMContentLoaded", connect);
})();
