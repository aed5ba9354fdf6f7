// Live subtitle viewer: subscribes to one stream on the server's /ws and shows the last
// lines, each as its stable text followed by the tentative tail (and, with ?source=1, the
// recognised source above it). `lang` picks the target language when the server
// translates into several (and tags the text for fonts). Plain browser JavaScript, no
// build step and nothing loaded from elsewhere.
//
// The first half of this file is what both viewer pages share (the transcript page,
// /transcript, loads this file before its own): the stream-id rules, the one default
// stream id, and the connection that subscribes, reconnects and resumes. The second half
// is the subtitle page itself and runs only where there is a #subtitles element.
"use strict";

const nmtViewer = (() => {
  // The stream a page shows when its URL names none: the id the server's startup banner
  // and examples/replay_client.py use too, so that following any of them shows something.
  const DEFAULT_STREAM = "demo";

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

  // What every viewer page reads from its URL: stream, lang, token.
  function readConfig(params) {
    const rawStream = params.get("stream") || DEFAULT_STREAM;
    return {
      stream: rawStream.normalize("NFC"),
      problem: streamIdProblem(rawStream),
      token: params.get("token"),
      lang: params.get("lang"),
    };
  }

  // A flag parameter: "?source=1" (also true/yes/on), anything else is off.
  function flagParam(params, name) {
    return ["1", "true", "yes", "on"].includes((params.get(name) || "").toLowerCase());
  }

  function quoted(text) {
    return "\u201c" + text + "\u201d";
  }

  // A refused subscribe in plain words: what cannot be shown, what the server said (its
  // message names the languages it has, or the token it wants) and what to change.
  function refusalText(error, stream) {
    const lead = "Cannot show stream " + quoted(stream);
    if (error.code === "unauthorized") {
      return `${lead}: watching it needs the viewer token, and this page has none or a ` +
        `wrong one. Open the link with &token=\u2026 that the server's operator gives ` +
        `viewers. (The server says: ${error.message})`;
    }
    if (error.field === "lang") {
      return `${lead} in this language. The server says: ${error.message}. ` +
        `Put one of those in the address as ?lang=\u2026`;
    }
    if (error.code === "limit_exceeded") {
      return `${lead}: the server is full. (It says: ${error.message})`;
    }
    return `${lead}. The server says: ${error.message}`;
  }

  function socketUrl(token) {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const query = token ? "?token=" + encodeURIComponent(token) : "";
    return scheme + "//" + window.location.host + "/ws" + query;
  }

  // Subscribe to `config.stream` and keep subscribed: reconnect with backoff when the
  // connection is lost, resuming after `resumeAfter()` (the last cursor the page had; the
  // server then sends exactly what it missed). Tells the page through `onState(state,
  // note)`: "connecting" (note: "connecting…" or "reconnecting…"), "open" (subscribed),
  // "closed" (waiting to retry, note says why and when) and "refused" (note in plain
  // words; nothing will ever show, so it stops retrying). `after`, when given, is what
  // the first subscribe asks for (the transcript's "0-0": everything the server kept).
  function follow(config, { onUpdate, onState, resumeAfter, after = null }) {
    let socket = null;
    let attempt = 0;
    let refused = false;
    let everOpened = false; // then a failed reconnect is the server away, not a bad token

    function refuse(note) {
      refused = true;
      onState("refused", note);
      if (socket) socket.close();
    }

    function connect() {
      onState("connecting", attempt ? "reconnecting\u2026" : "connecting\u2026");
      const ws = new WebSocket(socketUrl(config.token));
      socket = ws;
      let opened = false;
      ws.addEventListener("open", () => {
        opened = true;
        everOpened = true;
        const subscribe = { type: "subscribe", stream_id: config.stream };
        if (config.lang) subscribe.lang = config.lang;
        const from = resumeAfter() || after;
        if (from) subscribe.after = from;
        ws.send(JSON.stringify(subscribe));
        attempt = 0;
        onState("open", "");
      });
      ws.addEventListener("message", (event) => {
        let message;
        try {
          message = JSON.parse(event.data);
        } catch {
          return;
        }
        if (message.type === "translation_update" && message.stream_id === config.stream) {
          onUpdate(message);
        } else if (message.type === "error") {
          console.warn("subtitle server:", message.code, message.message);
          // A viewer sends nothing but its subscribe: an error refuses it (a stream id or a
          // language the server does not take, a token that may not watch). Only a server
          // shutting down is worth waiting for.
          if (message.code !== "unavailable") refuse(refusalText(message, config.stream));
        }
      });
      ws.addEventListener("close", () => {
        if (socket !== ws) return;
        socket = null;
        if (refused) return;
        // Exponential backoff with jitter: 0.5 s doubling up to 10 s.
        const delay = Math.min(10000, 500 * 2 ** attempt) * (0.5 + Math.random() / 2);
        attempt += 1;
        // A refused handshake looks like any failed connection to a page (browsers hide
        // the HTTP status), so name the likely causes when it never opened.
        let why = "cannot reach the server (down or full, or this page's token missing or wrong)";
        if (opened) why = "connection to the server lost";
        else if (everOpened) why = "the server is not answering";
        onState("closed", why + "; reconnecting in " + Math.ceil(delay / 1000) + " s");
        window.setTimeout(connect, delay);
      });
    }

    if (config.problem) {
      // The server would refuse this id: never connect, say why.
      refused = true;
      onState("refused", "Cannot show this stream: " + config.problem);
    } else {
      connect();
    }
  }

  return { DEFAULT_STREAM, readConfig, flagParam, follow, quoted };
})();

// --- the subtitle page ------------------------------------------------------------------

if (document.getElementById("subtitles")) {
  (() => {
    const params = new URLSearchParams(window.location.search);
    const root = document.documentElement;
    const body = document.body;
    const view = document.getElementById("subtitles");
    const status = document.getElementById("status");

    const config = {
      ...nmtViewer.readConfig(params),
      lines: intParam("lines", 2, 1, 50),
      // Seconds without a new update after which the lines fade out (0: never): a
      // speaker who stopped should not leave their last words up for ever.
      clear: numberParam("clear", 8, 0, 86400),
      source: nmtViewer.flagParam(params, "source"),
    };

    applyStyle();

    // Lines on screen, oldest first: {segment, final, el, source, stable, tentative}.
    const lines = [];
    let shownEpoch = null; // the stream life the lines belong to (`epoch` of its updates)
    // The last update's place in the stream's history: after a reconnect (to this server
    // or to another node of the service) the page asks for what came after it, so the
    // lines go on with nothing missed and nothing repeated.
    let cursor = null;
    let connection = { state: "connecting", note: "connecting\u2026" };
    let everShown = false; // whether any line was shown (then "nothing said yet" is wrong)
    let flash = null; // a short-lived note ("new stream") that replaces the waiting text
    let clearTimer = null;

    function intParam(name, fallback, min, max) {
      const value = Number.parseInt(params.get(name) || "", 10);
      return Number.isFinite(value) ? Math.min(max, Math.max(min, value)) : fallback;
    }

    function numberParam(name, fallback, min, max) {
      const value = Number.parseFloat(params.get(name) || "");
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
      if (config.lang) root.lang = config.lang;
      if (params.get("status") === "off") body.dataset.status = "off";
    }

    // The one place that decides what the page says: the connection's state, then, when
    // subscribed, what it waits for. The CSS shows it in the middle of an empty screen,
    // in a corner over lines (problems only: a subscribed page with lines says nothing).
    function render() {
      body.dataset.state = connection.state;
      body.dataset.view = lines.length ? "lines" : "empty";
      let note = connection.note;
      if (connection.state === "open") {
        const stream = nmtViewer.quoted(config.stream);
        note = flash || (everShown
          ? `stream ${stream}: waiting for the next words`
          : `waiting for stream ${stream} (nothing said yet)`);
      }
      status.textContent = note;
    }

    function setConnection(state, note) {
      connection = { state, note };
      render();
    }

    function newLine(segment) {
      const el = document.createElement("div");
      el.className = "line";
      // The recognised source, above its translation; lang="" because the page does not
      // know the source language (and must not tag it with the target's).
      const source = document.createElement("div");
      source.className = "source";
      source.lang = "";
      source.hidden = true;
      const text = document.createElement("div");
      text.className = "text";
      const stable = document.createElement("span");
      stable.className = "stable";
      const tentative = document.createElement("span");
      tentative.className = "tentative";
      text.append(stable, tentative);
      el.append(source, text);
      view.append(el);
      const line = { segment, final: false, el, source, stable, tentative };
      lines.push(line);
      while (lines.length > config.lines) lines.shift().el.remove();
      return line;
    }

    // Fade the lines out (CSS transition on .leaving), then remove them. They leave
    // `lines` at once, so that an update arriving during the fade starts a fresh line.
    function clearLines() {
      clearTimer = null;
      for (const line of lines.splice(0)) {
        line.el.classList.add("leaving");
        window.setTimeout(() => line.el.remove(), 700);
      }
      render();
    }

    function scheduleClear() {
      if (clearTimer !== null) window.clearTimeout(clearTimer);
      clearTimer = config.clear > 0 ? window.setTimeout(clearLines, config.clear * 1000) : null;
    }

    function show(update) {
      // A new epoch is a new life of the stream id (reopened, or another writer took it
      // over): what the old one said must not run on as if the same speaker went on.
      const epoch = update.epoch === undefined ? null : update.epoch;
      if (epoch !== null && shownEpoch !== null && epoch !== shownEpoch) {
        while (lines.length) lines.shift().el.remove();
        flash = "new stream";
        window.setTimeout(() => {
          flash = null;
          render();
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
      if (config.source && update.source_text) {
        line.source.textContent = update.source_text;
        line.source.hidden = false;
      }
      everShown = true;
      scheduleClear();
      render();
    }

    nmtViewer.follow(config, {
      onUpdate(update) {
        if (update.cursor) cursor = update.cursor;
        show(update);
      },
      onState: setConnection,
      resumeAfter: () => cursor,
    });
  })();
}
