// Live subtitle viewer: subscribes to one stream on the server's /ws and shows the last
// lines, each as its stable text followed by the tentative tail. `lang` picks the target
// language when the server translates into several (and tags the text for fonts). Plain browser JavaScript,
// no build step and nothing loaded from elsewhere.
"use strict";

(() => {
  const params = new URLSearchParams(window.location.search);
  const root = document.documentElement;
  const body = document.body;
  const view = document.getElementById("subtitles");
  const status = document.getElementById("status");

  // Stream ids as the server takes them (protocol/messages.py, `_check_stream_id`): at most
  // 128 code points, none of these characters (the same class as `_UNPRINTABLE`; a test
  // checks that the two agree), compared in NFC, so that "é" typed as one code point or as
  // "e" + combining accent names the one stream the server folds them into.
  const MAX_STREAM_ID_CHARS = 128;
  const UNPRINTABLE =
    /[\u0000-\u001f\u007f-\u009f\u00a0\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u08e2\u115f-\u1160\u17b4-\u17b5\u180b-\u180f\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb]/;

  function streamIdProblem(id) {
    const chars = [...id].length;
    if (chars > MAX_STREAM_ID_CHARS) {
      return `stream_id is ${chars} characters long; the limit is ${MAX_STREAM_ID_CHARS}`;
    }
    const bad = UNPRINTABLE.exec(id);
    if (bad) {
      const hex = bad[0].codePointAt(0).toString(16).toUpperCase().padStart(4, "0");
      return `stream_id contains the unprintable character U+${hex}`;
    }
    return null;
  }

  const rawStream = params.get("stream") || "main";
  const config = {
    stream: rawStream.normalize("NFC"),
    problem: streamIdProblem(rawStream),
    lines: intParam("lines", 2, 1, 50),
    token: params.get("token"),
    lang: params.get("lang"),
  };

  applyStyle();

  // Lines on screen, oldest first: {segment, final, el, stable, tentative}.
  const lines = [];
  let shownEpoch = null; // the stream life the lines belong to (`epoch` of its updates)
  // The last update's place in the stream's history: after a reconnect (to this server or
  // to another node of the service) the page asks for what came after it, so the lines
  // go on with nothing missed and nothing repeated.
  let cursor = null;
  let socket = null;
  let attempt = 0;

  function intParam(name, fallback, min, max) {
    const value = Number.parseInt(params.get(name) || "", 10);
    return Number.isFinite(value) ? Math.min(max, Math.max(min, value)) : fallback;
  }

  function cssValue(property, raw) {
    if (!raw) return null;
    // "ffcc00" in a URL is friendlier than "%23ffcc00".
    const candidates = /^[0-9a-f]{3,8}$/i.test(raw) ? ["#" + raw, raw] : [raw];
    return candidates.find((value) => CSS.supports(property, value)) || null;
  }

  function applyStyle() {
    const size = params.get("size");
    const px = size && /^\d+(\.\d+)?$/.test(size) ? size + "px" : size;
    const settings = [
      ["--size", cssValue("font-size", px)],
      ["--font", cssValue("font-family", params.get("font"))],
      ["--color", cssValue("color", params.get("color"))],
      ["--bg", cssValue("background-color", params.get("bg"))],
    ];
    for (const [name, value] of settings) {
      if (value) root.style.setProperty(name, value);
    }
    const lang = params.get("lang");
    if (lang) root.lang = lang;
    if (params.get("status") === "off") body.dataset.status = "off";
  }

  function setState(state, note) {
    body.dataset.state = state;
    status.textContent = note || "";
  }

  // The server refused what this page asks for (the stream id, the language, the token's
  // rights): nothing will ever show, so say why on the page and stop retrying.
  let refused = false;
  function refuse(note) {
    refused = true;
    setState("refused", note);
    if (socket) socket.close();
  }

  function newLine(segment) {
    const el = document.createElement("div");
    el.className = "line";
    const stable = document.createElement("span");
    stable.className = "stable";
    const tentative = document.createElement("span");
    tentative.className = "tentative";
    el.append(stable, tentative);
    view.append(el);
    const line = { segment, final: false, el, stable, tentative };
    lines.push(line);
    while (lines.length > config.lines) lines.shift().el.remove();
    return line;
  }

  function show(update) {
    // A new epoch is a new life of the stream id (reopened, or another writer took it
    // over): what the old one said must not run on as if the same speaker went on.
    const epoch = update.epoch === undefined ? null : update.epoch;
    if (epoch !== null && shownEpoch !== null && epoch !== shownEpoch) {
      while (lines.length) lines.shift().el.remove();
      status.textContent = "new stream";
      window.setTimeout(() => {
        if (status.textContent === "new stream") status.textContent = "";
      }, 3000);
    }
    if (epoch !== null) shownEpoch = epoch;
    // A stream's segments arrive in order; a lower id means the stream was restarted.
    let line = lines[lines.length - 1];
    if (!line || line.segment !== update.segment_id || (line.final && !update.is_final)) {
      line = newLine(update.segment_id);
    }
    // textContent, never HTML: the text comes from speech recognition and translation.
    line.stable.textContent = update.stable_text;
    line.tentative.textContent = update.unstable_text;
    line.final = update.is_final;
    line.el.classList.toggle("final", update.is_final);
  }

  function socketUrl() {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const query = config.token ? "?token=" + encodeURIComponent(config.token) : "";
    return scheme + "//" + window.location.host + "/ws" + query;
  }

  function connect() {
    setState("connecting", attempt ? "reconnecting…" : "connecting…");
    const ws = new WebSocket(socketUrl());
    socket = ws;
    let opened = false;
    ws.addEventListener("open", () => {
      opened = true;
      const subscribe = { type: "subscribe", stream_id: config.stream };
      if (config.lang) subscribe.lang = config.lang;
      if (cursor) subscribe.after = cursor;
      ws.send(JSON.stringify(subscribe));
      attempt = 0;
      setState("open");
    });
    ws.addEventListener("message", (event) => {
      let message;
      try {
        message = JSON.parse(event.data);
      } catch {
        return;
      }
      if (message.type === "translation_update" && message.stream_id === config.stream) {
        if (message.cursor) cursor = message.cursor;
        show(message);
      } else if (message.type === "error") {
        console.warn("subtitle server:", message.code, message.message);
        // A viewer sends nothing but its subscribe: an error refuses it (a stream id or a
        // language the server does not take, a token that may not watch). Only a server
        // shutting down is worth waiting for.
        if (message.code !== "unavailable") refuse(message.message);
      }
    });
    ws.addEventListener("close", () => {
      if (socket !== ws) return;
      socket = null;
      if (refused) return;
      // Exponential backoff with jitter: 0.5 s doubling up to 10 s.
      const delay = Math.min(10000, 500 * 2 ** attempt) * (0.5 + Math.random() / 2);
      attempt += 1;
      // A refused handshake looks like any failed connection to a page (browsers hide the
      // HTTP status), so name the likely causes when it never opened.
      const why = opened
        ? "not connected"
        : "cannot connect (server down or full, or this page's token missing or wrong)";
      setState("closed", why + "; retrying in " + Math.ceil(delay / 1000) + " s");
      window.setTimeout(connect, delay);
    });
  }

  if (config.problem) {
    // The server would refuse this id: never connect, say why.
    setState("refused", "cannot show this stream: " + config.problem);
  } else {
    connect();
  }
})();
