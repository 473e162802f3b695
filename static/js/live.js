// The one live socket of every page. Reconnects by itself with backoff, shows its state in the
// header, re-subscribes after a reconnect, and hands each message to the page's handlers.
(function () {
  "use strict";
  const handlers = [];
  const jobSubscriptions = new Set();
  let socket = null;
  let attempt = 0;
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
      attempt = 0;
      showState("live", "live");
      jobSubscriptions.forEach((id) => send({ action: "subscribe_job", job_id: id }));
    });
    socket.addEventListener("message", function (event) {
      let message;
      try { message = JSON.parse(event.data); } catch (err) { return; }
      handlers.forEach((handler) => handler(message));
    });
    socket.addEventListener("close", function () {
      attempt += 1;
      const delay = Math.min(10000, 250 * 2 ** Math.min(attempt, 6));
      showState("offline", "offline — retrying in " + Math.round(delay / 1000) + " s");
      setTimeout(connect, delay);
    });
  }

  function send(message) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(message));
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

  window.BungeeLive = {
    on: (handler) => handlers.push(handler),
    subscribeJob: (id) => { jobSubscriptions.add(id); send({ action: "subscribe_job", job_id: id }); },
    post: post,
    errorText: errorText,
    bootstrap: () => JSON.parse(document.getElementById("bootstrap").textContent),
  };
  document.addEventListener("DOMContentLoaded", connect);
})();
