// The speaker page (/speak?stream=ID): the browser's microphone, sent to the server as an
// audio stream (start_audio, then binary frames of 16-bit mono PCM at 16 kHz, ~100 ms
// each, made by pcm-worklet.js), and what comes back: the server echoes what it heard as
// partial_transcript messages and sends the translation as translation_update messages,
// shown as lines: what was heard, and its translation under it (as the subtitle page shows
// them with ?source=1). Before Start it asks the server (/info) whether it takes audio at
// all. Needs `nmtViewer` from subtitles.js (loaded first) for the stream-id rules and the
// default stream.
//
// Plain browser JavaScript with no dependency and no build step: the server serves its
// pages under a Content-Security-Policy that lets them load nothing from elsewhere, and
// the page has to be readable by whoever runs the server.
//
// The speaker may give the stream a glossary of its own (its text typed in the box, or a
// file's): sent as set_glossary before the audio starts on every connection (so the server
// has it before the first partial, and again after a drop), its acknowledgement
// (glossary_set) or refusal shown under the box.
//
// A dropped connection is reconnected (backoff with jitter, as the viewer pages do) and
// the audio stream started again on the new one; what is said while there is no
// connection is not kept (sending it late would only delay what follows).
"use strict";

(() => {
  const TARGET_RATE = 16000; // what the recognizer hears; the worklet downsamples to it
  const FRAME_MS = 100;
  const MAX_LINES = 6;
  // Past this many bytes waiting in the socket (the network stalls), frames are dropped
  // rather than queued: live speech that arrives seconds late is worth less than none.
  const MAX_BUFFERED = 256 * 1024;
  const NOTE_MS = 6000; // how long a passing note (audio dropped, recognizer restarted) shows
  const RESTART_MS = 10000; // a recognizer failing twice within this long is given up on

  const params = new URLSearchParams(window.location.search);
  const config = nmtViewer.readConfig(params);
  const quoted = nmtViewer.quoted;

  const body = document.body;
  const status = document.getElementById("status");
  const startButton = document.getElementById("start");
  const stopButton = document.getElementById("stop");
  const level = document.getElementById("level");
  const view = document.getElementById("lines");
  const glossaryBox = document.getElementById("glossary");
  const glossaryFile = document.getElementById("glossary-file");
  const glossaryButton = document.getElementById("glossary-send");
  const glossaryStatus = document.getElementById("glossary-status");
  const MAX_GLOSSARY_BYTES = 32768; // what set_glossary takes (docs/protocol.md)

  document.getElementById("title").textContent = "Speak into " + quoted(config.stream);
  document.title = "Speak: " + config.stream;
  const viewer = new URLSearchParams({ stream: config.stream });
  if (config.lang) viewer.set("lang", config.lang);
  document.getElementById("viewer").href = "./?" + viewer.toString();

  // idle | starting (asking for the microphone) | connecting | listening | closed
  // (waiting to reconnect) | stopped | refused (the server or the browser said no)
  let state = "idle";
  let note = "";
  let passing = null; // a short-lived note shown while listening: {text, until}
  let wanted = false; // Start pressed, Stop not (yet)
  let asking = true; // waiting for /info: Start waits too
  let noAudio = false; // /info said the server takes no audio
  let socket = null;
  let streaming = false; // start_audio sent on `socket`
  let attempt = 0;
  let everOpened = false;
  let retryTimer = null;
  let microphone = null; // {stream, context, node}
  let shownLevel = 0;
  let shownLang = null; // the target language shown, when the page's URL names none
  let lastRestart = -Infinity; // when the audio stream was last started again after a failure
  let glossary = ""; // the glossary text given: sent on every connection before start_audio
  let accepted = ""; // the last one the server acknowledged (a refused one leaves it in use)
  let inFlight = []; // the texts sent on this connection and not answered yet, oldest first
  let glossaryLine = ""; // what the last acknowledgement said
  let languages = { source: "", targets: [] }; // from /info: a glossary's header names them
  // Lines by segment id, oldest first; segment ids are numbered per connection, so a new
  // connection starts a new generation of keys.
  let generation = 0;
  const lines = [];

  function setState(next, text) {
    state = next;
    note = text || "";
    render();
  }

  // The one place that decides what the page says and which buttons work.
  function render() {
    body.dataset.state = state;
    body.dataset.view = lines.length ? "lines" : "empty";
    let text = note;
    if (state === "listening") {
      const stream = quoted(config.stream);
      text = passing && passing.until > Date.now()
        ? passing.text
        : `listening: speak now (what you say goes to stream ${stream})`;
    }
    status.textContent = text;
    startButton.disabled = wanted || asking || noAudio || state === "starting" ||
      Boolean(config.problem) || !window.isSecureContext;
    stopButton.disabled = !wanted;
  }

  function pass(text) {
    passing = { text, until: Date.now() + NOTE_MS };
    render();
    window.setTimeout(render, NOTE_MS + 50);
  }

  function idleNote() {
    return `Press Start and speak: what you say is translated live into stream ` +
      `${quoted(config.stream)}, for the viewers of its subtitle page.`;
  }

  // --- the microphone ---------------------------------------------------------------------

  async function openMicrophone() {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true },
    });
    // The context runs at the device's rate (a context at 16 kHz would make some browsers
    // refuse the microphone's stream); the worklet downsamples.
    const context = new AudioContext();
    try {
      await context.audioWorklet.addModule("pcm-worklet.js");
      const source = context.createMediaStreamSource(stream);
      const node = new AudioWorkletNode(context, "pcm-downsampler", {
        processorOptions: { targetRate: TARGET_RATE, frameMs: FRAME_MS },
      });
      node.port.onmessage = (event) => onFrame(event.data);
      source.connect(node);
      // Silent on the speakers, but connected to the output so that the browser runs it.
      const mute = context.createGain();
      mute.gain.value = 0;
      node.connect(mute).connect(context.destination);
      await context.resume();
      microphone = { stream, context, node };
    } catch (error) {
      for (const track of stream.getTracks()) track.stop();
      context.close();
      throw error;
    }
  }

  function closeMicrophone() {
    if (!microphone) return;
    const { stream, context, node } = microphone;
    microphone = null;
    node.port.onmessage = null;
    node.port.postMessage("stop");
    for (const track of stream.getTracks()) track.stop(); // the browser's "recording" mark goes
    context.close();
    showLevel(0);
  }

  function microphoneProblem(error) {
    const name = error && error.name;
    if (name === "NotAllowedError" || name === "SecurityError") {
      return "The browser did not allow the microphone: allow it for this page (the icon " +
        "in the address bar) and press Start again.";
    }
    if (name === "NotFoundError" || name === "OverconstrainedError") {
      return "No microphone found: plug one in (or pick one in the browser's settings) and " +
        "press Start again.";
    }
    if (name === "NotReadableError") {
      return "The microphone is busy or failed (another program may hold it); press Start " +
        "to try again.";
    }
    return `The microphone could not start (${(error && error.message) || error}).`;
  }

  function onFrame(frame) {
    showLevel(frame.rms);
    if (!socket || socket.readyState !== WebSocket.OPEN || !streaming) return;
    if (socket.bufferedAmount > MAX_BUFFERED) return;
    socket.send(frame.pcm);
  }

  // RMS to a bar: -60 dBFS (silence) to 0 dBFS; falls back slowly, like a VU meter.
  function showLevel(rms) {
    const db = 20 * Math.log10(Math.max(rms, 1e-6));
    const target = Math.min(1, Math.max(0, (db + 60) / 60));
    shownLevel = Math.max(target, shownLevel * 0.7);
    level.style.width = (shownLevel * 100).toFixed(1) + "%";
    level.classList.toggle("loud", db > -3);
  }

  // --- the connection -----------------------------------------------------------------------

  function socketUrl() {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const query = config.token ? "?token=" + encodeURIComponent(config.token) : "";
    return scheme + "//" + window.location.host + "/ws" + query;
  }

  function connect() {
    retryTimer = null;
    if (socket || !wanted) return;
    setState("connecting", attempt ? "reconnecting\u2026" : "connecting\u2026");
    const ws = new WebSocket(socketUrl());
    ws.binaryType = "arraybuffer";
    socket = ws;
    let opened = false;
    ws.addEventListener("open", () => {
      if (socket !== ws) return;
      opened = true;
      everOpened = true;
      attempt = 0;
      generation += 1;
      inFlight = [];
      sendGlossary();
      if (wanted) startAudio();
    });
    ws.addEventListener("message", (event) => {
      if (socket !== ws || typeof event.data !== "string") return;
      let message;
      try {
        message = JSON.parse(event.data);
      } catch {
        return;
      }
      receive(message);
    });
    ws.addEventListener("close", () => {
      if (socket !== ws) return;
      socket = null;
      streaming = false;
      if (!wanted || state === "refused") return;
      // Exponential backoff with jitter: 0.5 s doubling up to 10 s.
      const delay = Math.min(10000, 500 * 2 ** attempt) * (0.5 + Math.random() / 2);
      attempt += 1;
      let why = "cannot reach the server (down or full, or this page's token missing or wrong)";
      if (opened) why = "connection to the server lost";
      else if (everOpened) why = "the server is not answering";
      setState("closed", `${why}; reconnecting in ${Math.ceil(delay / 1000)} s ` +
        "(what is said meanwhile is not heard)");
      retryTimer = window.setTimeout(connect, delay);
    });
  }

  function startAudio() {
    const start = { type: "start_audio", stream_id: config.stream, sample_rate: TARGET_RATE };
    socket.send(JSON.stringify(start));
    streaming = true;
    setState("listening");
  }

  function endAudio() {
    if (socket && socket.readyState === WebSocket.OPEN && streaming) {
      socket.send(JSON.stringify({ type: "end_audio", stream_id: config.stream }));
    }
    streaming = false;
  }

  function receive(message) {
    if (message.type === "error" && message.field === "glossary") {
      // Refused (a bad line, too large): the server keeps the one before, and so does the
      // page for the next connection; the audio goes on.
      inFlight.shift();
      glossary = accepted;
      sayGlossary("The server did not take the glossary: " + message.message +
        (accepted ? "; the one given before stays in use." : "."), true);
    } else if (message.type === "error") {
      onError(message);
    } else if (message.stream_id !== config.stream) {
      return;
    } else if (message.type === "glossary_set") {
      if (inFlight.length) accepted = inFlight.shift();
      const terms = message.entries === 1 ? "1 term" : `${message.entries} terms`;
      glossaryLine = message.entries
        ? `Glossary in use: ${terms} into ${message.lang}.`
        : `No glossary into ${message.lang} now.`;
      sayGlossary(glossaryLine);
    } else if (message.type === "partial_transcript") {
      const line = lineFor(message.segment_id);
      line.source.textContent = message.text; // never HTML: it is what was heard
      line.source.classList.toggle("final", message.is_final);
      render();
    } else if (message.type === "translation_update" && wantsLang(message.lang)) {
      const line = lineFor(message.segment_id);
      line.stable.textContent = message.stable_text;
      line.tentative.textContent = message.unstable_text;
      line.el.classList.toggle("final", message.is_final);
      render();
      if (message.is_final && accepted) showTerms(message.lang);
    }
  }

  // A writer gets its streams' updates in every language the server translates into:
  // show the one the URL asks for, else the first one that comes.
  function wantsLang(lang) {
    if (!lang) return true;
    const base = (tag) => tag.toLowerCase().split(/[-_]/)[0];
    if (config.lang) return base(config.lang) === base(lang);
    if (shownLang === null) shownLang = lang;
    return lang === shownLang;
  }

  // What each error means for the speaker. Most are passing notes (the audio goes on);
  // a refusal (no audio on this server, no right to write the stream, the server full)
  // stops the page, since nothing would change by trying again.
  function onError(error) {
    const code = error.code;
    console.warn("speak: server:", code, error.message);
    if (code === "rate_limited" && error.field === "type") {
      // start_audio was not taken for now (the server is starting others' audio): the
      // frames stop until it is sent again, in a second or two.
      streaming = false;
      pass("The server is starting other speakers' audio; trying again\u2026");
      const ws = socket;
      window.setTimeout(() => {
        if (wanted && socket === ws && ws.readyState === WebSocket.OPEN && !streaming) {
          startAudio();
        }
      }, 1000 + Math.random() * 1000);
    } else if (code === "rate_limited") {
      pass("Some audio was dropped: " + error.message);
    } else if (code === "internal" && error.seq === undefined) {
      // The recognizer failed: the audio stream ended (what it heard was finished). Start
      // again, unless it failed just as much a moment ago (it would only fail again).
      if (Date.now() - lastRestart < RESTART_MS) {
        refuse(`The server's recognizer keeps failing. (The server says: ${error.message})`);
        return;
      }
      lastRestart = Date.now();
      pass("The server's recognizer failed; listening again.");
      if (wanted && socket && socket.readyState === WebSocket.OPEN) startAudio();
    } else if (code === "unavailable") {
      pass("The server is shutting down; reconnecting when it is back.");
    } else if (error.seq !== undefined && !["unauthorized", "forbidden", "limit_exceeded"]
      .includes(code)) {
      pass("The server could not translate what was heard: " + error.message);
    } else {
      refuse(refusalText(error));
    }
  }

  function refusalText(error) {
    const lead = "Cannot speak into stream " + quoted(config.stream);
    if (error.code === "unauthorized") {
      return `${lead}: writing it needs the writer token (or this stream's key), and this ` +
        `page has none or a wrong one. Open the link with &token=\u2026 that the server's ` +
        `operator gives speakers. (The server says: ${error.message})`;
    }
    if (error.field === "type" && error.code === "invalid_message") {
      return `${lead}: ${error.message}.`; // "this server takes no audio: start it with ..."
    }
    if (error.code === "limit_exceeded") {
      return `${lead}: the server cannot take it now. (It says: ${error.message})`;
    }
    return `${lead}. The server says: ${error.message}`;
  }

  function refuse(text) {
    wanted = false;
    streaming = false;
    closeMicrophone();
    setState("refused", text);
    if (socket) socket.close();
  }

  // --- lines ----------------------------------------------------------------------------------

  function lineFor(segment) {
    const key = generation + "/" + segment;
    let line = lines.find((l) => l.key === key);
    if (line) return line;
    const el = document.createElement("div");
    el.className = "line";
    const text = document.createElement("div");
    text.className = "translation";
    if (config.lang) text.lang = config.lang;
    const stable = document.createElement("span");
    stable.className = "stable";
    const tentative = document.createElement("span");
    tentative.className = "tentative";
    text.append(stable, tentative);
    // What was heard, above its translation, as the subtitle page's ?source=1 places it;
    // lang="" because the page does not know the source language.
    const source = document.createElement("div");
    source.className = "source";
    source.lang = "";
    el.append(source, text);
    view.append(el);
    line = { key, el, stable, tentative, source };
    lines.push(line);
    while (lines.length > MAX_LINES) lines.shift().el.remove();
    return line;
  }

  // --- the glossary ------------------------------------------------------------------------------

  function sayGlossary(text, problem) {
    glossaryStatus.textContent = text;
    glossaryStatus.classList.toggle("problem", Boolean(problem));
  }

  // After a final, how the glossary did in the stream so far (the server's /terms).
  async function showTerms(lang) {
    const query = new URLSearchParams({ stream: config.stream });
    if (config.token) query.set("token", config.token);
    try {
      const response = await fetch("terms?" + query.toString(), { cache: "no-store" });
      if (!response.ok) return;
      const counts = (await response.json()).terms[lang];
      // A refusal shown stays until the next acknowledgement.
      if (counts && !glossaryStatus.classList.contains("problem")) {
        sayGlossary(`${glossaryLine} In what was said so far: ${counts.matched} ` +
          `matched, ${counts.placed} placed.`);
      }
    } catch (error) {
      console.warn("speak: /terms:", error);
    }
  }

  // The first line that is not blank nor a comment: the languages, source<TAB>target.
  function headerOf(text) {
    return text.split("\n").find((line) => line.trim() && !line.trim().startsWith("#")) || "";
  }

  // Take the box's text as the stream's glossary (an emptied box: the languages alone,
  // which clears the one given before) and send it now if connected.
  function useGlossary() {
    const text = glossaryBox.value.trim() ? glossaryBox.value : headerOf(glossary);
    if (!text) {
      sayGlossary("No glossary: type one in the box, or pick a file.", true);
      return;
    }
    const size = new TextEncoder().encode(text).length;
    if (size > MAX_GLOSSARY_BYTES) {
      sayGlossary(`The glossary is ${size} bytes; the server takes at most ` +
        `${MAX_GLOSSARY_BYTES}.`, true);
      return;
    }
    glossary = text;
    if (socket && socket.readyState === WebSocket.OPEN) sendGlossary();
    else sayGlossary("The glossary is sent when you press Start.");
  }

  function sendGlossary() {
    if (!glossary || !socket || socket.readyState !== WebSocket.OPEN) return;
    socket.send(JSON.stringify({ type: "set_glossary", stream_id: config.stream, glossary }));
    inFlight.push(glossary);
    sayGlossary("sending the glossary\u2026");
  }

  // An empty box starts with the languages' line, as the server's /info names them.
  glossaryBox.addEventListener("focus", () => {
    const target = config.lang || languages.targets[0];
    if (!glossaryBox.value && languages.source && target) {
      glossaryBox.value = `${languages.source}\t${target}\n`;
    }
  });

  // Tab types a tab (the column separator); Esc, then Tab, leaves the box as usual.
  let escaped = false;
  glossaryBox.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      escaped = true;
      return;
    }
    if (event.key === "Tab" && !event.shiftKey && !escaped && !event.ctrlKey && !event.altKey) {
      event.preventDefault();
      glossaryBox.setRangeText("\t", glossaryBox.selectionStart, glossaryBox.selectionEnd, "end");
    }
    escaped = false;
  });

  glossaryFile.addEventListener("change", async () => {
    const file = glossaryFile.files && glossaryFile.files[0];
    if (!file) return;
    if (file.size > MAX_GLOSSARY_BYTES) {
      sayGlossary(`${file.name} is ${file.size} bytes; the server takes at most ` +
        `${MAX_GLOSSARY_BYTES}.`, true);
      return;
    }
    glossaryBox.value = await file.text();
    useGlossary();
  });

  glossaryButton.addEventListener("click", useGlossary);

  // --- the buttons ------------------------------------------------------------------------------

  startButton.addEventListener("click", async () => {
    if (wanted) return;
    wanted = true;
    // What the box holds when Start is pressed is the glossary, unless one was given.
    if (glossaryBox.value.trim() && !glossary) useGlossary();
    setState("starting", "asking for the microphone\u2026");
    try {
      await openMicrophone();
    } catch (error) {
      wanted = false;
      setState("refused", microphoneProblem(error));
      return;
    }
    if (!wanted) {
      closeMicrophone(); // Stop was pressed meanwhile
      return;
    }
    if (socket && socket.readyState === WebSocket.OPEN) startAudio();
    else connect();
  });

  stopButton.addEventListener("click", () => {
    wanted = false;
    endAudio(); // the last utterance still gets its final and translation
    closeMicrophone();
    if (retryTimer !== null) {
      window.clearTimeout(retryTimer);
      retryTimer = null;
    }
    setState("stopped", "stopped; press Start to speak again");
  });

  // Whether the server takes audio, asked before anyone presses Start: a server without a
  // recognizer is said so once, and the microphone is never asked for. A server that
  // cannot answer (an older one, a proxy in between) is tried: start_audio's reply says.
  async function askServer() {
    try {
      const response = await fetch("info", { cache: "no-store" });
      if (response.ok) {
        const info = await response.json();
        languages = { source: info.source || "", targets: info.languages || [] };
        if (languages.source && languages.targets.length) {
          document.getElementById("glossary-note").textContent =
            `(${languages.source} \u2192 ${languages.targets.join(", ")})`;
        }
        if (info.audio === false) {
          noAudio = true;
          return `Cannot speak into stream ${quoted(config.stream)}: ${info.no_audio}.`;
        }
      }
    } catch (error) {
      console.warn("speak: /info:", error);
    }
    return null;
  }

  if (config.problem) {
    asking = false;
    setState("refused", "Cannot speak into this stream: " + config.problem);
  } else if (!window.isSecureContext || !navigator.mediaDevices) {
    asking = false;
    setState("refused", "Browsers give the microphone only to secure pages: open this page " +
      "as https://\u2026, or as http://localhost\u2026 on the computer that runs the server.");
  } else {
    setState("idle", "asking the server whether it takes audio\u2026");
    askServer().then((refusal) => {
      asking = false;
      if (refusal) setState("refused", refusal);
      else setState("idle", idleNote());
    });
  }
})();
