"""The answers in flight: one decode batch per prefix (answering.decode_batch.DecodeBatch), and a unit that gives
every answer its next token(s).

    lane = AnswerLane(engine)
    lane.start(owner, item)       an Answer (scheduler.work) joins the batch of its prefix at the next unit: a stored
                                  calibration's rows [0, b) (every query on it shares one batch, the production case)
                                  or, for an answer from embeddings, its own rows [0, b) (a batch of its own)
    done, rows = lane.unit()      one read interval of every batch, in turn -> ([(owner, Generation | None, error)],
                                  the rows it decoded)
    lane.drop(owner)              its rows leave now (a cancelled request)

A batch holds rows of one rotary table (rope types that depend on the length: Transformer.fit_rope), so its key is
the prefix and that table's lengths. A backend without the fast decoder (transformers') has no query-only path: its
answers decode the full matrix (Engine.generate), one whole answer a unit.
"""
from __future__ import annotations

import logging

from ..answering.answer import embeddings_prefix
from ..answering.answer_kv import supports_kv_answers
from ..answering.decode_batch import AnswerRow, DecodeBatch
from ..answering.reuse import full_embeddings

log = logging.getLogger("sicl_fast.scheduler")


def listener(on_text):
    """An answer's stop_fn that tells on_text(text) of each token and never stops it, unless on_text fails (its
    stream is gone): then that answer stops there, and the batch goes on."""
    if on_text is None:
        return None

    def stop_fn(text: str) -> bool:
        try:
            on_text(text)
        except BaseException:  # noqa: BLE001 - the listener's own failure (asyncio.CancelledError too) ends its answer only
            log.warning("an answer's listener failed; that answer stops here", exc_info=True)
            return True
        return False
    return stop_fn


class AnswerLane:
    """The answers in flight on one engine, batched per prefix (module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.kv = supports_kv_answers(engine.backend)
        self.batches: dict[tuple, DecodeBatch] = {}
        self.rows: dict[AnswerRow, tuple] = {}  # row -> (owner, its batch key)
        self.whole: list[tuple] = []  # (owner, item): answers of a backend without the query-only path
        self.tokens = 0  # tokens decoded, every row's

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.whole)

    @property
    def size(self) -> int:
        """Answers in flight."""
        return len(self.rows) + len(self.whole)

    def prefix(self, item):
        """(the Calibration the item decodes against, the query's own rows after it [T, d], whether the prefix is
        its own) for an Answer: module docstring. From embeddings X, both are X's (a calibration that perturbed the
        query rows changed those too)."""
        backend = self.engine.backend
        if item.calibration is not None:
            cal = item.calibration
            return cal, backend.embed(item.prompt)[cal.length:], False
        X = item.embeddings if item.embeddings is not None else backend.embed(item.prompt)
        cal = embeddings_prefix(item.prompt, X, self.engine.lm.name)
        return cal, X[cal.length:].float(), True

    def start(self, owner, item) -> None:
        """Queue the item's row in its prefix's batch (it is prefilled at the next unit); errors raise here."""
        if not self.kv:
            self.whole.append((owner, item))
            return
        cal, rows, own = self.prefix(item)
        backend, m = self.engine.backend, self.engine.backend.model
        rope = tuple(r.key(item.prompt.length) for r in m.rotary.values())
        key = (id(cal) if own or not cal.key else cal.key, rope)
        row = AnswerRow(item.prompt, rows, item.max_new_tokens, tuple(item.stop_strings), listener(item.on_text))
        batch = self.batches.get(key)
        if batch is None:
            batch = DecodeBatch(backend, cal, None if own else self.engine.store)
        batch.join(row)  # checks (context, values) before the batch is kept
        self.batches.setdefault(key, batch)
        if row.done:  # max_new_tokens 0: answered at once, at the next unit
            self.whole.append((owner, row))
        else:
            self.rows[row] = (owner, key)

    def drop(self, owner) -> None:
        for row, (o, key) in list(self.rows.items()):
            if o is owner:
                self.batches[key].drop(row)
                del self.rows[row]
                self._forget(key)
        self.whole = [(o, it) for o, it in self.whole if o is not owner]

    def _forget(self, key) -> None:
        if not self.batches[key].size:
            del self.batches[key]  # its buffers go; a later answer on the prefix starts a new batch

    def unit(self) -> tuple[list[tuple], int]:
        """One read interval of every batch, in turn -> ([(owner, Generation | None, error)], rows decoded)."""
        done, decoded = [], 0
        if self.whole:
            owner, what = self.whole.pop(0)
            if isinstance(what, AnswerRow):  # a row that had nothing to decode
                done.append((owner, what.out, None))
            else:
                done.append(self._whole(owner, what))
            decoded += 1
        for key, batch in list(self.batches.items()):
            decoded += len(batch.rows) + len(batch.joining)
            before = batch.tokens
            try:
                stopped = batch.advance()
            except BaseException as exc:  # noqa: BLE001 - the batch's rows fail, the others go on
                log.error("a decode batch failed; its %d answers fail with it", batch.size, exc_info=exc)
                for row in [r for r, (_, k) in self.rows.items() if k == key]:
                    done.append((self.rows.pop(row)[0], None, exc))
                del self.batches[key]
                continue
            self.tokens += batch.tokens - before
            for row in stopped:
                done.append((self.rows.pop(row)[0], row.out, None))
            self._forget(key)
        return done, decoded

    def _whole(self, owner, item) -> tuple:
        """A backend without the query-only path: the full matrix's greedy answer, whole."""
        eng = self.engine
        try:
            X = (full_embeddings(eng, item.calibration, item.prompt) if item.calibration is not None
                 else item.embeddings)
            gen = eng.generate(item.prompt, X, max_new_tokens=item.max_new_tokens, stop_strings=item.stop_strings,
                               stop_fn=listener(item.on_text))
        except BaseException as exc:  # noqa: BLE001 - the answer's own failure
            return owner, None, exc
        self.tokens += len(gen.token_ids)
        return owner, gen, None


__all__ = ["AnswerLane"]
