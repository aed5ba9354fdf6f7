"""pocketsphinx 5 as a sans-I/O `Recognizer`: utterances ended by its voice activity
endpointer, partial hypotheses while it decodes, a final at the end of each utterance.

pocketsphinx has no type stubs: the library is held as `Any` in this module only, and
every value that leaves it is converted to a plain typed one here.

How an utterance goes: `Endpointer` (WebRTC-style voice activity over 30 ms frames, with
a decision window of `silence_s`) returns speech frames, the first ones with the audio
just before speech began; the first starts an utterance (`Decoder.start_utt`), each is
decoded (`process_raw`), every `partial_every_ms` of speech the decoder's best hypothesis
so far (`hyp()`) becomes a partial, and when the endpointer has heard enough silence the
utterance ends (`end_utt`) and its hypothesis is the final. Where noise keeps the
endpointer in speech, `engine.asr.levels.LevelCut` ends a long utterance at a pause
relative to the noise floor, or at `max_utterance_s`. pocketsphinx gives no stability
hint (a partial's words may all change), so `stable_chars` stays None.
"""

from __future__ import annotations

import contextlib
import math
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.asr.errors import RecognizerUnavailable, import_extra
from engine.asr.levels import PAUSE_AFTER_S, LevelCut
from engine.asr.memory import release_memory
from engine.asr.recognizer import SpeechHypothesis

SAMPLE_RATE = 16_000  # the rate of pocketsphinx's en-US acoustic model


def pocketsphinx() -> Any:
    """The pocketsphinx module (`RecognizerUnavailable` with the install hint if absent)."""
    return import_extra("pocketsphinx", package="'pocketsphinx>=5'")


FILE_LIMITS: dict[str, int] = {
    "lm": 2 * 2**30,
    "dict": 256 * 2**20,
    "jsgf": 16 * 2**20,
    "hmm": 2 * 2**30,
    "domain_text": 64 * 2**20,
}
"""Largest file the recognizer reads, by option (pocketsphinx's en-US model: a 27 MB
language model, a 3.3 MB dictionary, acoustic model files up to 3 MB). pocketsphinx reads
what it is given to the end, so a device such as /dev/zero would never load and a huge
file would take the memory; `check_recognizer_file` refuses both at start."""

_WHAT = {
    "lm": "language model",
    "dict": "dictionary",
    "jsgf": "grammar",
    "hmm": "acoustic model",
    "domain_text": "domain text",
}


def check_recognizer_file(path: Path, option: str) -> None:
    """Refuse (`RecognizerUnavailable`, one line naming `path`) what the recognizer's
    `option` ("lm", "dict", "jsgf", "domain_text"; "hmm": a directory of such files) may
    not read: a missing path, anything but a regular file (a directory, a device, a
    pipe), a file over `FILE_LIMITS`."""
    what = _WHAT[option]
    try:
        found = path.stat()
    except OSError as exc:
        raise RecognizerUnavailable(f"{path}: {_reason(exc)} ({what})") from None
    if option == "hmm":
        if not stat.S_ISDIR(found.st_mode):
            raise RecognizerUnavailable(f"{path}: not a directory ({what})")
        for entry in sorted(path.iterdir()):
            if entry.is_dir():
                continue
            _check_regular(entry, what, FILE_LIMITS[option])
        return
    _check_regular(path, what, FILE_LIMITS[option])


def _reason(exc: OSError) -> str:
    """ "no such file or directory", as the engine's other errors say it."""
    reason = exc.strerror or "cannot be read"
    return reason[:1].lower() + reason[1:]


def _check_regular(path: Path, what: str, limit: int) -> None:
    try:
        found = path.stat()
    except OSError as exc:
        raise RecognizerUnavailable(f"{path}: {_reason(exc)} ({what})") from None
    if not stat.S_ISREG(found.st_mode):
        raise RecognizerUnavailable(f"{path}: not a regular file ({what})")
    if found.st_size > limit:
        raise RecognizerUnavailable(
            f"{path}: {found.st_size / 2**20:.0f} MiB, more than a {what} may be "
            f"({limit // 2**20} MiB)"
        )


def check_dictionary(decoder: Any, path: Path) -> None:
    """Refuse a dictionary the decoder loaded none or only part of: pocketsphinx skips,
    silently, every line that is not WORD PHONE... with its acoustic model's phones, so a
    text file that is no dictionary made a recognizer that never recognizes a word."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise RecognizerUnavailable(f"{path}: {_reason(exc)} (dictionary)") from None
    lines = [
        (n, line.split())
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.startswith(("##", ";;"))  # its comments
    ]
    if not lines:
        raise RecognizerUnavailable(f"{path}: an empty dictionary")
    for number, fields in lines:
        if decoder.lookup_word(fields[0]) is None:
            shown = " ".join(fields)[:60]
            raise RecognizerUnavailable(
                f"{path}: not a pronunciation dictionary: line {number} ({shown!r}) is not "
                "WORD PHONE... with the acoustic model's phones"
            )


@dataclass(frozen=True)
class SphinxOptions:
    """What pocketsphinx recognizes and how utterances are cut.

    `language_model` (ARPA, optionally gzipped, or pocketsphinx's binary `.lm.bin`) or
    `grammar` (a JSGF file; `grammar_rule` its top rule, default its first public one)
    says what may be said; with neither, the package's general en-US model. A closed
    domain recognizes far better with its own model (`engine.asr.build_domain_model`).
    `dictionary`: pronunciations (default the package's CMUdict); `acoustic_model`: a
    model directory (default the package's en-US one).
    `silence_s`: the endpointer's window; an utterance ends once `vad_ratio` of that long
    is not speech (and starts once that share of it is), so it is both how long a pause
    must be to cut a sentence and the least delay of every final after speech ends.
    `vad_mode`: 0 (loose) to 3 (strict) about what counts as speech.
    `max_utterance_s`: where noise keeps the endpointer in speech, an utterance past
    `engine.asr.levels.PAUSE_AFTER_S` (or half of this, if less) ends at the next pause
    heard against the noise floor, and at this length wherever it is.
    `partial_every_ms`: how much speech between partial hypotheses (each is a decode for
    the translator, and a back-trace for the decoder).
    `config`: other pocketsphinx options, by their names (e.g. {"beam": 1e-60}).
    """

    language_model: Path | None = None
    grammar: Path | None = None
    grammar_rule: str | None = None
    dictionary: Path | None = None
    acoustic_model: Path | None = None
    silence_s: float = 0.3
    vad_ratio: float = 0.9
    vad_mode: int = 0
    max_utterance_s: float = 20.0
    partial_every_ms: float = 100.0
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.language_model is not None and self.grammar is not None:
            raise ValueError("give a language model or a grammar, not both")
        if self.grammar_rule is not None and self.grammar is None:
            raise ValueError("grammar_rule needs a grammar")
        if not (math.isfinite(self.silence_s) and 0.06 <= self.silence_s <= 10.0):
            raise ValueError(f"silence_s must be between 0.06 and 10 seconds, not {self.silence_s}")
        if not 0.0 < self.vad_ratio < 1.0:
            raise ValueError(f"vad_ratio must be between 0 and 1, not {self.vad_ratio}")
        if self.vad_mode not in (0, 1, 2, 3):
            raise ValueError(f"vad_mode must be 0, 1, 2 or 3, not {self.vad_mode}")
        if not (math.isfinite(self.max_utterance_s) and 1.0 <= self.max_utterance_s <= 600.0):
            raise ValueError(
                f"max_utterance_s must be between 1 and 600 seconds, not {self.max_utterance_s}"
            )
        if not (math.isfinite(self.partial_every_ms) and self.partial_every_ms > 0):
            raise ValueError("partial_every_ms must be a positive number")

    def decoder_config(self) -> dict[str, Any]:
        """The keyword arguments of `pocketsphinx.Decoder` these options make."""
        out: dict[str, Any] = {"samprate": SAMPLE_RATE, "loglevel": "FATAL"}
        for key, path in (
            ("hmm", self.acoustic_model),
            ("dict", self.dictionary),
            ("lm", self.language_model),
            ("jsgf", self.grammar),
        ):
            if path is not None:
                check_recognizer_file(Path(path), key)
                out[key] = str(path)
        if self.grammar is not None:
            out["lm"] = None  # the grammar replaces the default language model
            if self.grammar_rule is not None:
                out["toprule"] = self.grammar_rule
        out.update(self.config)
        return out


def _ms(pcm: bytes) -> float:
    """How long 16-bit mono `pcm` lasts at `SAMPLE_RATE`, in ms."""
    return len(pcm) * 500.0 / SAMPLE_RATE


KEEP_IDLE = 2
"""Idle decoders a process keeps per configuration for the next streams (`Decoders`)."""

_OTHER_SEARCHES = ("jsgf", "fsg", "kws", "keyphrase", "allphone")
"""Decoder options that replace the n-gram search (whose language model is shared)."""


class Decoders:
    """A process's pocketsphinx decoders, kept across streams (thread-safe).

    A decoder loads its acoustic model, dictionary and search on its own (tens of MB,
    a few tenths of a second for the general en-US model), and pocketsphinx does not share
    them between decoders, except the n-gram language model: decoders of one
    configuration share the first one's (`add_lm`), the largest part of the general
    model (pocketsphinx holds the GIL in its calls, so decoders in threads never use it
    at once). A stream's decoder comes back when its stream ends (`give_back`), its
    cepstral mean reset to the model's, and the next stream takes it instead of loading
    one; up to `keep_idle` wait per configuration, the rest are freed and their memory
    given back to the system (`release_memory`), so a process holds what its open
    streams need plus a few, not what its busiest moment needed.
    """

    def __init__(self, keep_idle: int = KEEP_IDLE) -> None:
        self.keep_idle = keep_idle
        self.made = 0  # decoders loaded (not taken from the idle ones)
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[Any, str]]] = {}
        self._models: dict[str, Any] = {}  # the shared language model per configuration

    def take(self, config: Mapping[str, Any]) -> tuple[Any, str]:
        """A decoder for `config` (`SphinxOptions.decoder_config`) and its initial
        cepstral mean: an idle one, else a new one (`RecognizerUnavailable`)."""
        key = repr(sorted(config.items()))
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
            shared = self._models.get(key)
        ps = pocketsphinx()
        try:
            if shared is not None:
                decoder: Any = ps.Decoder(**{**config, "lm": None})
                decoder.add_lm("shared", shared)
                decoder.activate_search("shared")
            else:
                decoder = ps.Decoder(**config)
                if config.get("dict"):
                    check_dictionary(decoder, Path(config["dict"]))
                lm = None if any(k in config for k in _OTHER_SEARCHES) else decoder.get_lm()
                if lm is not None:
                    with self._lock:
                        self._models.setdefault(key, lm)
        except (RuntimeError, ValueError, OSError) as exc:
            raise RecognizerUnavailable(
                f"pocketsphinx could not load its model ({exc}): check the language "
                "model, grammar, dictionary and acoustic model files"
            ) from exc
        with self._lock:
            self.made += 1
        return decoder, str(decoder.get_cmn(False))

    def give_back(self, config: Mapping[str, Any], decoder: Any, cmn: str) -> bool:
        """A stream is done with `decoder` (out of any utterance): kept for the next
        one, reset, if fewer than `keep_idle` wait; False: the caller lets it go (then
        `release_memory`)."""
        key = repr(sorted(config.items()))
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) >= self.keep_idle:
                return False
        try:
            decoder.set_cmn(cmn)  # a new speaker starts from the model's mean
        except Exception:
            return False
        with self._lock:
            if len(idle) >= self.keep_idle:
                return False
            idle.append((decoder, cmn))
        return True

    def idle(self) -> int:
        """Decoders waiting for a stream."""
        with self._lock:
            return sum(len(idle) for idle in self._idle.values())

    def clear(self) -> None:
        """Free the idle decoders and the shared language models (the process will make
        no more recognizers, or a test starts afresh)."""
        with self._lock:
            self._idle.clear()
            self._models.clear()
        release_memory()


DECODERS = Decoders()
"""This process's decoders: in a recognition worker, those of its streams."""


class SphinxRecognizer:
    """pocketsphinx behind the `Recognizer` protocol (16 kHz 16-bit mono PCM).

    Its decoder comes from `decoders` (default the process's `DECODERS`): loading the
    general en-US model takes a few tenths of a second, a domain model far less, and a
    decoder given back by an ended stream is taken at once. `close` gives it back. Not
    thread-safe: one recognizer per stream.
    """

    sample_rate: int = SAMPLE_RATE

    def __init__(
        self, options: SphinxOptions | None = None, decoders: Decoders | None = None
    ) -> None:
        self.options = options or SphinxOptions()
        self._decoders = DECODERS if decoders is None else decoders
        self._config = self.options.decoder_config()
        ps = pocketsphinx()
        try:
            self._endpointer: Any = ps.Endpointer(
                window=self.options.silence_s,
                ratio=self.options.vad_ratio,
                vad_mode=self.options.vad_mode,
                sample_rate=SAMPLE_RATE,
            )
        except ValueError as exc:
            raise ValueError(f"pocketsphinx's endpointer refused its options: {exc}") from exc
        self._decoder: Any
        self._decoder, self._cmn = self._decoders.take(self._config)
        self._frame_bytes = int(self._endpointer.frame_bytes)
        self._levels = LevelCut(
            frame_s=float(self._endpointer.frame_length),
            window_s=self.options.silence_s,
            ratio=self.options.vad_ratio,
            long_s=min(PAUSE_AFTER_S, self.options.max_utterance_s / 2),
            max_s=self.options.max_utterance_s,
        )
        # The endpointer is still in speech after a level cut: its next speech frames
        # continue from `_speech_ms` (the audio time they start at).
        self._held = False
        self._speech_ms = 0.0
        self._pending = bytearray()
        self._in_utterance = False
        self._failed = False  # the decoder raised once (see `close`)
        self._utterance_start_ms = 0.0
        self._utterance_samples = 0  # speech given to the decoder in this utterance
        self._partial_at = 0  # `_utterance_samples` at the last partial
        self._samples = 0  # audio accepted, all of it

    @property
    def heard_ms(self) -> float:
        return self._samples * 1000.0 / SAMPLE_RATE

    def accept(self, pcm: bytes) -> list[SpeechHypothesis]:
        """Recognize the next audio (any length, whole samples); the hypotheses made."""
        self._samples += len(pcm) // 2
        self._pending += pcm
        out: list[SpeechHypothesis] = []
        size = self._frame_bytes
        frames = len(self._pending) // size
        try:
            for i in range(frames):
                out += self._frame(bytes(self._pending[i * size : (i + 1) * size]))
        except Exception:
            self._recover()
            raise
        finally:
            del self._pending[: frames * size]
        return out

    def flush(self) -> list[SpeechHypothesis]:
        """End of audio: the utterance in progress ends (what is left shorter than a frame
        goes to the endpointer's end of stream)."""
        rest, self._pending = bytes(self._pending), bytearray()
        if not self._in_utterance:
            return []
        try:
            # `end_stream` refuses empty input (pocketsphinx 5.1.1: "Out of bounds on buffer
            # access") when the audio so far was a whole number of frames.
            speech = self._endpointer.end_stream(rest) if rest else None
            if speech is not None:
                self._decode(bytes(speech))
            return [self._end(self.heard_ms)]
        except Exception:
            self._recover()
            raise

    def _frame(self, frame: bytes) -> list[SpeechHypothesis]:
        self._levels.hear(frame)
        speech = self._endpointer.process(frame)
        if speech is None:
            self._held = False
            return []
        speech = bytes(speech)
        if not self._in_utterance:
            if self._held:
                at, self._speech_ms = self._speech_ms, self._speech_ms + _ms(speech)
                if self._levels.quiet(speech):  # noise between two cut utterances
                    self._held = self._endpointer.in_speech
                    return []
            else:
                at = float(self._endpointer.speech_start) * 1000.0
            self._decoder.start_utt()
            self._in_utterance = True
            self._levels.restart()
            self._utterance_start_ms = at
            self._utterance_samples = self._partial_at = 0
        self._decode(speech)
        if not self._endpointer.in_speech:
            self._held = False
            return [self._end(float(self._endpointer.speech_end) * 1000.0)]
        if self._levels.ends(speech, self._utterance_samples / SAMPLE_RATE):
            self._held = True
            self._speech_ms = self._end_ms
            return [self._end(self._end_ms)]
        every = self.options.partial_every_ms * SAMPLE_RATE / 1000.0
        if self._utterance_samples - self._partial_at < every:
            return []
        self._partial_at = self._utterance_samples
        return [SpeechHypothesis(self._hypothesis(), False, self._utterance_start_ms, self._end_ms)]

    @property
    def _end_ms(self) -> float:
        return self._utterance_start_ms + self._utterance_samples * 1000.0 / SAMPLE_RATE

    def _decode(self, speech: bytes) -> None:
        self._decoder.process_raw(speech, False, False)
        self._utterance_samples += len(speech) // 2

    def _end(self, end_ms: float) -> SpeechHypothesis:
        self._decoder.end_utt()
        self._in_utterance = False
        end = max(self._utterance_start_ms, end_ms)
        return SpeechHypothesis(self._hypothesis(), True, self._utterance_start_ms, end)

    def _hypothesis(self) -> str:
        hyp = self._decoder.hyp()
        return "" if hyp is None else str(hyp.hypstr)

    def close(self) -> None:
        """The stream is done: its decoder goes back to `decoders` (out of the utterance
        it was in; one that cannot leave it, or that raised, is freed). Idempotent; the
        recognizer is not called again."""
        decoder, self._decoder = self._decoder, None
        if decoder is None:
            return
        kept = False
        try:
            if not self._failed and self._in_utterance:
                self._in_utterance = False
                decoder.end_utt()
            if not self._failed:
                kept = self._decoders.give_back(self._config, decoder, self._cmn)
        except Exception:
            kept = False
        finally:
            del decoder
        if not kept:
            release_memory()

    def _recover(self) -> None:
        """After an error: leave the utterance, so that the next audio starts afresh."""
        self._failed = True  # its decoder is not given to another stream
        if self._in_utterance:
            self._in_utterance = False
            # A decoder past helping says so at the next start_utt.
            with contextlib.suppress(Exception):
                self._decoder.end_utt()
