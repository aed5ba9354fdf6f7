"""Where an utterance may end when the voice activity endpointer does not end it.

WebRTC-style voice activity calls steady noise speech: in loud white noise
pocketsphinx's endpointer never heard a pause, and `listen` gave one final for a whole
recording (docs/speech.md, "Noisy audio", has the figures). Finals are what a viewer keeps and what
the translator commits, so an utterance that never ends is a stream that never settles,
and a source that outgrows the model is refused. This module is the fallback, measured
against the audio's own noise floor instead of an absolute voice model:

- the floor is the lowest frame level heard, rising slowly (`FLOOR_RISE_DB_S`) so that it
  follows noise that grows; a frame within `QUIET_DB` of it is quiet;
- once an utterance has run `long_s`, a pause of quiet frames (the endpointer's own window
  and ratio) ends it; at `max_s` it ends wherever it is;
- after such a cut, the frames the endpointer still calls speech start the next utterance
  only once one is louder than quiet, so that the noise between sentences is not decoded.

Pure NumPy over 16-bit PCM, apart from the recognizer, so that it is tested on its own.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

QUIET_DB = 3.0
"""How far over the noise floor a frame may be and still count as a pause: steady noise's
frames stay close to their floor, while speech even well under the noise's power rises
above it."""

FLOOR_RISE_DB_S = 1.0
"""How fast the floor follows noise that grows (dB a second); it falls at once."""

PAUSE_AFTER_S = 1.5
"""How long an utterance runs before a pause against the floor may end it (or half of
`max_utterance_s`, if less): long enough for the floor to be known and for the
endpointer to end an utterance in clean audio first, short enough that a sentence in
noise ends near its own end rather than the next one's."""

SILENT_DB = -100.0
"""The level of digital silence (a frame of zeros), instead of minus infinity."""


def level_db(pcm: bytes) -> float:
    """The mean power of 16-bit little-endian mono `pcm`, in dB of full scale squared
    (a full-scale square wave is about 90 dB)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    if not samples.size:
        return SILENT_DB
    power = float(np.mean(samples * samples))
    return max(SILENT_DB, 10.0 * math.log10(power)) if power > 0 else SILENT_DB


class LevelCut:
    """The noise floor and the pause rule of one stream (module docstring).

    `frame_s`: the length of a frame given to `hear` and `quiet`; `window_s` and `ratio`:
    a pause is `ratio` of the last `window_s` quiet (the endpointer's `silence_s` and
    `vad_ratio`); `long_s` and `max_s`: when a pause may end an utterance, and when it
    ends without one."""

    def __init__(
        self, *, frame_s: float, window_s: float, ratio: float, long_s: float, max_s: float
    ) -> None:
        if not 0 < long_s <= max_s:
            raise ValueError(f"long_s must be in (0, max_s], not {long_s} (max_s {max_s})")
        self.long_s = long_s
        self.max_s = max_s
        self._rise = FLOOR_RISE_DB_S * frame_s
        size = max(1, round(window_s / frame_s))
        self._window: deque[bool] = deque(maxlen=size)
        self._needed = ratio * size
        self.floor: float | None = None

    def hear(self, pcm: bytes) -> None:
        """Every frame of the input, speech or not, moves the floor."""
        level = level_db(pcm)
        self.floor = level if self.floor is None else min(level, self.floor + self._rise)

    def quiet(self, pcm: bytes) -> bool:
        """Whether `pcm` is within `QUIET_DB` of the floor (never before a floor)."""
        return self.floor is not None and level_db(pcm) <= self.floor + QUIET_DB

    def restart(self) -> None:
        """A new utterance: the pause window starts empty."""
        self._window.clear()

    def ends(self, pcm: bytes, utterance_s: float) -> bool:
        """Whether the utterance, `utterance_s` long with `pcm` its last decoded frame,
        ends here: a pause once it is `long_s` long, or anywhere at `max_s`."""
        self._window.append(self.quiet(pcm))
        if utterance_s >= self.max_s:
            return True
        return utterance_s >= self.long_s and sum(self._window) >= self._needed
