"""Speech recognizers behind the streaming layer's seam (`engine.streaming.recognizer`).

Each adapter wraps one recognition library as a sans-I/O `Recognizer` and does nothing
else: the seam resamples, numbers events and runs recognition off the event loop. The
libraries are optional extras, imported when a recognizer is made (not when this package
is), so that the engine installs and imports without them:

- `SphinxRecognizer` (`pip install -e '.[asr]'`: pocketsphinx 5, CPU, ships an en-US
  model): its voice activity endpointer ends utterances, partial hypotheses as it decodes.
  `build_domain_model` turns a domain's sentences into a language model and pronunciation
  dictionary for it (much better recognition of a closed vocabulary).
"""

from engine.asr.domain import DomainModel, build_domain_model, normalize_words
from engine.asr.errors import RecognizerUnavailable
from engine.asr.sphinx import SphinxOptions, SphinxRecognizer

__all__ = [
    "DomainModel",
    "RecognizerUnavailable",
    "SphinxOptions",
    "SphinxRecognizer",
    "build_domain_model",
    "normalize_words",
]
