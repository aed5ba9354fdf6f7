"""The speech layer: audio in, `PartialTranscript` events out. It depends on `protocol`,
numpy and the facts modules only, so that whatever takes audio (`listen`, the server's
audio route, the bridges) uses one seam and the translation layers know nothing of speech.

- `engine.asr.audio`: audio sources (WAV, raw PCM, pipes, pushed frames), rates,
  resampling;
- `engine.asr.recognizer`: the recognizer seam (`Recognizer`, `RecognizerStream`,
  `SpeechStream`);
- `engine.asr.transcriber`: one stream's recognition off the event loop, into a
  translator;
- `engine.asr.pool` (with `engine.asr.worker`): recognition in worker processes;
- `engine.asr.memory`: what a recognizer's streams cost in memory (measured in a process
  like a worker), and freed memory given back to the system;
- `engine.asr.errors`: the errors of all of these.

Each adapter wraps one recognition library as a sans-I/O `Recognizer` and does nothing
else. The libraries are optional extras, imported when a recognizer is made (not when this
package is), so that the engine installs and imports without them:

- `SphinxRecognizer` (`pip install -e '.[asr]'`: pocketsphinx 5, CPU, ships an en-US
  model): its voice activity endpointer ends utterances, partial hypotheses as it decodes.
  `build_domain_model` turns a domain's sentences into a language model and pronunciation
  dictionary for it (much better recognition of a closed vocabulary).
"""
