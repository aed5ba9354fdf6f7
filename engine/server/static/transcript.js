// The transcript page (/transcript?stream=ID): every final of one stream, oldest first,
// with its time, source and translation, following the stream live, and subtitle files
// (WebVTT, SubRip) built from them in the browser. Needs `nmtViewer` from subtitles.js
// (loaded first: the stream-id rules and the connection are the subtitle page's).
//
// It subscribes with `after: "0-0"`, which asks for everything the server keeps of the
// stream (a few hundred updates), keeps the finals (each once, by its cursor: a history
// read and a live read may overlap) and, after a lost connection, resumes after the last
// cursor it had, so nothing is missed and nothing repeated.
"use strict";

const nmtTranscript = (() => {
  // --- subtitle files: pure functions of the finals (the tests call them) ---------------

  // A cue shorter than this is hard to read; a final whose segment the page saw nothing
  // else of (no partial: it joined late) gets at least this long.
  const MIN_CUE_MS = 1000;
  // A final with an audio start but no end: shown this long, or until the next one starts.
  const DEFAULT_CUE_MS = 3000;

  function pad(number, width) {
    return String(number).padStart(width, "0");
  }

  // HH:MM:SS.mmm (WebVTT, separator ".") or HH:MM:SS,mmm (SubRip, separator ",").
  function timestamp(ms, separator) {
    const total = Math.max(0, Math.round(ms));
    const hours = Math.floor(total / 3600000);
    const minutes = Math.floor(total / 60000) % 60;
    const seconds = Math.floor(total / 1000) % 60;
    return `${pad(hours, 2)}:${pad(minutes, 2)}:${pad(seconds, 2)}${separator}${pad(total % 1000, 3)}`;
  }

  // When each cue shows, in ms from the start of the file. The audio times the recogniser
  // gave (`start_ms`/`end_ms`) when every final has them and they run forward (a stream
  // reopened under the same id starts its clock again); otherwise the server's times: from
  // the first update of a final's segment to the final, counted from the first one's.
  function cues(finals) {
    const shown = finals.filter((f) => f.text.trim());
    const audio = shown.every(
      (f, i) => f.startMs !== null && (i === 0 || f.startMs >= shown[i - 1].startMs),
    );
    const origin = shown.length ? shown[0].firstSeen : 0;
    return shown.map((f, i) => {
      let start;
      let end;
      if (audio) {
        start = f.startMs;
        const next = shown[i + 1];
        const until = next && next.startMs > start ? next.startMs : Infinity;
        end = f.endMs !== null ? f.endMs : Math.min(start + DEFAULT_CUE_MS, until);
      } else {
        start = f.firstSeen - origin;
        end = f.arrived - origin;
      }
      return { start, end: Math.max(end, start + MIN_CUE_MS), text: oneLine(f.text) };
    });
  }

  // A blank line ends a cue in both formats: a cue's text is kept on one line.
  function oneLine(text) {
    return text.trim().replace(/\s*\n\s*/g, " ");
  }

  function buildVtt(finals) {
    // In WebVTT cue text "&" and "<" start markup, and "-->" may not appear: escape them.
    const escape = (text) =>
      text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
    const body = cues(finals).map(
      (cue, i) =>
        `${i + 1}\n${timestamp(cue.start, ".")} --> ${timestamp(cue.end, ".")}\n` +
        `${escape(cue.text)}\n`,
    );
    return ["WEBVTT\n", ...body].join("\n");
  }

  function buildSrt(finals) {
    return cues(finals)
      .map(
        (cue, i) =>
          `${i + 1}\n${timestamp(cue.start, ",")} --> ${timestamp(cue.end, ",")}\n${cue.text}\n`,
      )
      .join("\n");
  }

  // --- cursors ----------------------------------------------------------------------------

  // Cursors are "MS-N", two numbers of up to 20 digits (past what a float holds exactly).
  function cursorKey(cursor) {
    const [ms, n] = cursor.split("-");
    return [BigInt(ms), BigInt(n)];
  }

  function cursorBefore(a, b) {
    const [am, an] = cursorKey(a);
    const [bm, bn] = cursorKey(b);
    return am < bm || (am === bm && an < bn);
  }

  // When the server published an update. Its cursor begins with that time in ms where the
  // server numbers its history by the clock (its own bus and Redis both do), which gives
  // finals read back from the history their real times; otherwise, now.
  function publishedAt(update) {
    const ms = update.cursor ? Number(update.cursor.split("-")[0]) : 0;
    return ms > 1e12 ? ms : Date.now();
  }

  // --- the page -----------------------------------------------------------------------------

  const finals = []; // ordered by cursor: {cursor, epoch, segment, source, text, ...}

  function finalsCopy() {
    return finals.map((f) => ({ ...f }));
  }

  function start() {
    const params = new URLSearchParams(window.location.search);
    const config = nmtViewer.readConfig(params);
    const body = document.body;
    const status = document.getElementById("status");
    const list = document.getElementById("finals");
    const vttButton = document.getElementById("download-vtt");
    const srtButton = document.getElementById("download-srt");

    const seen = new Set(); // cursors of the finals kept
    const segmentStart = new Map(); // "epoch:segment" -> when its first update came
    let lastCursor = null; // the newest cursor of any update: where a reconnect resumes
    let connection = { state: "connecting", note: "connecting\u2026" };

    const name = nmtViewer.quoted(config.stream) + (config.lang ? ` (${config.lang})` : "");
    document.getElementById("title").textContent = "Transcript of stream " + name;
    document.title = `Transcript: ${config.stream}` + (config.lang ? ` (${config.lang})` : "");
    if (config.lang) document.documentElement.dataset.lang = config.lang;
    const live = new URLSearchParams();
    for (const key of ["stream", "lang", "token"]) {
      if (params.get(key)) live.set(key, params.get(key));
    }
    document.getElementById("live").href = "./?" + live.toString();

    function render() {
      body.dataset.state = connection.state;
      let note = connection.note;
      if (connection.state === "open") {
        const stream = nmtViewer.quoted(config.stream);
        if (finals.length) {
          note = `${finals.length} final${finals.length === 1 ? "" : "s"}; following live`;
        } else if (lastCursor) {
          note = `stream ${stream}: its first sentence is under way`;
        } else {
          note = `waiting for stream ${stream} (nothing said yet)`;
        }
      }
      status.textContent = note;
      vttButton.disabled = srtButton.disabled = finals.length === 0;
    }

    // Audio time in the stream (m:ss.s, h:mm:ss.s past an hour).
    function streamTime(ms) {
      const tenths = Math.round(ms / 100);
      const hours = Math.floor(tenths / 36000);
      const minutes = Math.floor(tenths / 600) % 60;
      const seconds = (tenths % 600) / 10;
      const ss = seconds.toFixed(1).padStart(4, "0");
      return hours ? `${hours}:${pad(minutes, 2)}:${ss}` : `${minutes}:${ss}`;
    }

    // Wall-clock time (HH:MM:SS, the viewer's time zone).
    function clockTime(ms) {
      const d = new Date(ms);
      return `${pad(d.getHours(), 2)}:${pad(d.getMinutes(), 2)}:${pad(d.getSeconds(), 2)}`;
    }

    function item(final, previous) {
      const li = document.createElement("li");
      li.className = "final";
      li.dataset.cursor = final.cursor;
      // A new life of the stream id (closed and reopened, or taken over) gets a rule.
      if (previous && final.epoch !== null && previous.epoch !== null &&
          final.epoch !== previous.epoch) {
        li.classList.add("new-life");
      }
      const when = document.createElement("time");
      when.className = "when";
      if (final.startMs !== null) {
        const end = final.endMs !== null ? "\u2013" + streamTime(final.endMs) : "";
        when.textContent = streamTime(final.startMs) + end;
        when.title = "audio time in the stream";
      } else {
        when.textContent = clockTime(final.arrived);
        when.dateTime = new Date(final.arrived).toISOString();
        when.title = "when the server translated it";
      }
      const texts = document.createElement("div");
      texts.className = "texts";
      if (final.source) {
        const source = document.createElement("p");
        source.className = "source";
        source.lang = ""; // the source language is not known here
        source.textContent = final.source;
        texts.append(source);
      }
      const translation = document.createElement("p");
      translation.className = "translation";
      if (final.lang) translation.lang = final.lang; // picks the right font for CJK
      translation.textContent = final.text; // textContent, never HTML
      texts.append(translation);
      li.append(when, texts);
      return li;
    }

    function add(update) {
      const key = `${update.epoch}:${update.segment_id}`;
      const at = publishedAt(update);
      if (!segmentStart.has(key)) segmentStart.set(key, at);
      if (update.cursor && (!lastCursor || cursorBefore(lastCursor, update.cursor))) {
        lastCursor = update.cursor;
      }
      if (!update.is_final) return;
      const id = update.cursor || `${key}:${update.seq}`;
      if (seen.has(id)) return; // a history read and a live read overlapped
      seen.add(id);
      const final = {
        cursor: id,
        epoch: update.epoch === undefined ? null : update.epoch,
        segment: update.segment_id,
        source: update.source_text || "",
        text: update.stable_text,
        lang: update.lang || null,
        startMs: typeof update.start_ms === "number" ? update.start_ms : null,
        endMs: typeof update.end_ms === "number" ? update.end_ms : null,
        firstSeen: segmentStart.get(key),
        arrived: at,
      };
      // The segment is over: a writer that numbers from 0 again starts a new one.
      segmentStart.delete(key);
      // Follow live only if the reader is at the bottom: never yank them back down from
      // something they scrolled up to read.
      const following =
        window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 80;
      const last = finals[finals.length - 1];
      if (!last || !update.cursor || cursorBefore(last.cursor, id)) {
        finals.push(final);
        list.append(item(final, last));
      } else {
        // Out of order (rare: a resumed read): put it in its place and redraw.
        const index = finals.findIndex((f) => cursorBefore(id, f.cursor));
        finals.splice(index, 0, final);
        list.replaceChildren(...finals.map((f, i) => item(f, finals[i - 1])));
      }
      if (following) window.scrollTo(0, document.documentElement.scrollHeight);
    }

    function download(extension, text, type) {
      const safe = (config.stream + (config.lang ? "." + config.lang : "")).replace(
        /[^\p{L}\p{N}._-]+/gu,
        "_",
      );
      const url = URL.createObjectURL(new Blob([text], { type }));
      const a = document.createElement("a");
      a.href = url;
      a.download = `${safe}.${extension}`;
      document.body.append(a);
      a.click();
      a.remove();
      window.setTimeout(() => URL.revokeObjectURL(url), 10000);
    }

    vttButton.addEventListener("click", () =>
      download("vtt", buildVtt(finals), "text/vtt;charset=utf-8"),
    );
    srtButton.addEventListener("click", () =>
      download("srt", buildSrt(finals), "application/x-subrip;charset=utf-8"),
    );

    nmtViewer.follow(config, {
      onUpdate(update) {
        add(update);
        render();
      },
      onState(state, note) {
        connection = { state, note };
        render();
      },
      resumeAfter: () => lastCursor,
      after: "0-0",
    });
  }

  start();
  return { buildVtt, buildSrt, timestamp, finals: finalsCopy };
})();
