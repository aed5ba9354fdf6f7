"""Fan-out: one source language translated into several target languages at once.

A `Targets` holds one `Translator` per target language, keyed by the language each model
says it translates into (`target_lang` in its `nmt-incremental.json` or tokenizer config,
which `models pull` writes from the catalog). It is checked once, at start: every model
must translate from the same source language (a writer sends its transcript once, for
all of them) and no two into the same language (a viewer picks a language, so each must
name exactly one model). The first model's language is the default, what a viewer that
names no language gets.

Each model keeps its own decode scheduler (rows of different models cannot share a
decoder call); `load` splits the cores it is given between them (`model_share`), so that
their lanes and threads together fit the machine.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.decoding.scheduler import SchedulerOptions
from engine.decoding.translator import Translator
from engine.errors import EngineError, ModelLoadError
from engine.glossary import Glossary, GlossaryError
from engine.languages import match_lang


def model_share(cores: int | None, models: int) -> int:
    """Each of `models` schedulers' cores out of `cores` (default: the machine's), so that
    together they run one call per core, never more (at least one each)."""
    return max(1, (cores or os.cpu_count() or 1) // models)


UNKNOWN_LANG = "und"
"""The key of a lone model that does not say its target language (BCP 47 "undetermined");
with several models, not saying it is an error."""


class Targets(Mapping[str, Translator]):
    """Translators by target language (short code, e.g. "zh", "de"), in the order given;
    the first is the default language."""

    def __init__(self, translators: Sequence[Translator]) -> None:
        if not translators:
            raise ValueError("at least one translator is needed")
        self._by_lang: dict[str, Translator] = {}
        sources: dict[str, Translator] = {}
        for translator in translators:
            lang = translator.config.target_lang
            if lang is None:
                if len(translators) > 1:
                    raise ModelLoadError(
                        f"{_name(translator)}: cannot tell which language it translates into; "
                        'set "target_lang" in its nmt-incremental.json to use it with '
                        "other models"
                    )
                lang = UNKNOWN_LANG
            other = self._by_lang.get(lang)
            if other is not None:
                raise ModelLoadError(
                    f"{_name(other)} and {_name(translator)} both translate into {lang!r}: "
                    "give one model per target language"
                )
            source = translator.config.source_lang
            if source is not None:
                sources.setdefault(source, translator)
            self._by_lang[lang] = translator
        if len(sources) > 1:
            (a, first), (b, second) = list(sources.items())[:2]
            raise ModelLoadError(
                f"{_name(first)} translates from {a!r} but {_name(second)} from {b!r}: "
                "every model of a fan-out must translate the same source language"
            )
        self.source_lang: str | None = next(iter(sources), None)

    @property
    def default(self) -> str:
        """The first model's language: what a viewer that names none receives."""
        return next(iter(self._by_lang))

    @property
    def languages(self) -> list[str]:
        return list(self._by_lang)

    def __getitem__(self, lang: str) -> Translator:
        return self._by_lang[lang]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_lang)

    def __len__(self) -> int:
        return len(self._by_lang)

    def find(self, tag: str) -> str | None:
        """The language of `tag` that a model translates into ("zh-Hans" -> "zh"), or
        None: viewers and pages write tags, models are keyed by base code."""
        return match_lang(tag, self._by_lang)

    def close(self) -> None:
        """Stop every model's scheduler."""
        for translator in self._by_lang.values():
            translator.close()

    @classmethod
    def load(
        cls,
        models: Sequence[str | Path],
        *,
        resolve: Callable[[str], Path] | None = None,
        scheduler: SchedulerOptions | None = None,
        cores: int | None = None,
        **kwargs: Any,
    ) -> Targets:
        """Load each model once (`resolve` turns a catalog name into a directory) with
        `cores` (default: the machine's) split between them, then check the set. Raises
        `ModelLoadError` naming the model that failed (or the conflict between two);
        models already loaded are closed."""
        share = model_share(cores, len(models))
        options = dataclasses.replace(scheduler or SchedulerOptions(), cores=share)
        loaded: list[Translator] = []
        try:
            for spec in models:
                try:
                    path = resolve(str(spec)) if resolve is not None else Path(spec)
                    loaded.append(Translator.from_dir(path, scheduler=options, **kwargs))
                except EngineError as exc:  # a bad directory, or a catalog name not found
                    raise ModelLoadError(f"cannot load model {str(spec)!r}: {exc}") from exc
            return cls(loaded)
        except BaseException:
            for translator in loaded:
                translator.close()
            raise


def _name(translator: Translator) -> str:
    return f"model {str(translator.model.model_dir)!r}"


def glossaries_by_language(
    glossaries: Glossary | Sequence[Glossary], targets: Targets
) -> dict[str, Glossary]:
    """Each glossary keyed by the target language whose model it is for, checked against
    that model (`Translator.constraints`'s rules: languages and vocabulary). Two for one
    language, or one for a language no model translates into, is a `GlossaryError`."""
    chosen = [glossaries] if isinstance(glossaries, Glossary) else list(glossaries)
    by_lang: dict[str, Glossary] = {}
    for glossary in chosen:
        lang = match_lang(glossary.target_lang, targets.languages)
        if lang is None:
            served = ", ".join(targets.languages)
            raise GlossaryError(
                f"a glossary into {glossary.target_lang!r}, but the models translate into {served}"
            )
        if lang in by_lang:
            raise GlossaryError(f"two glossaries into {lang!r}: merge them into one file")
        targets[lang].terms.check(glossary)
        by_lang[lang] = glossary
    return by_lang
