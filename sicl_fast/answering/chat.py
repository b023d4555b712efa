"""Chat messages -> a few-shot Request, through the model's own chat template.

    messages = [system?] (user assistant)+ user
        system (or developer)   the instruction: the fixed prefix, never perturbed
        user / assistant pairs  the demonstrations; each assistant turn's content is an output span
        the last user turn      the query

The conversation is rendered with the model's chat template (the tokenizer's, else the one a GGUF file carries)
as the model would see it, ending with the template's assistant header (add_generation_prompt). The output spans
are the assistant turns' content characters; the demonstrations start at the first user turn's content.

`StreamCut` turns the decoded text of a growing answer into deltas that add up to the final answer.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import RequestError
from ..backends.generate import cut_at_stops
from ..formats.requests import Request, check_text

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SHAPE = "an optional system message, then alternating user / assistant turns (the demonstrations, at least one " \
        "pair), ending with a user turn (the query)"


# what the OpenAI API sends that a few-shot prompt of text cannot hold, in words: content parts by type, and the
# fields and roles of tool calling
NOT_TEXT = {"image_url": "images are", "input_image": "images are", "image": "images are", "input_audio": "audio is",
            "audio": "audio is", "file": "files are", "input_file": "files are"}
TOOL_FIELDS = ("tool_calls", "function_call")
TOOL_ROLES = ("tool", "function")


def message_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}). Anything else is
    refused naming the part: an image, audio or a file is not supported (the prompt is text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        got = "null" if content is None else type(content).__name__
        raise RequestError(f"{where}: content must be a string or a list of text parts, got {got}")
    for k, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in NOT_TEXT:
            raise RequestError(f"{where}: content[{k}] is a part of type {kind!r}: {NOT_TEXT[kind]} not supported "
                               "(the calibrated prompt is text); send text parts ({\"type\": \"text\", \"text\": "
                               "...}) or a string")
        if kind == "text" and not isinstance(p.get("text"), str):
            got = "nothing" if "text" not in p else "null" if p["text"] is None else type(p["text"]).__name__
            raise RequestError(f"{where}: content[{k}].text must be a string, got {got}")
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "not a text part"
            raise RequestError(f"{where}: content[{k}] is {what}; content must be a string or a list of text parts "
                               "({\"type\": \"text\", \"text\": ...})")
    return "".join(p["text"] for p in content)


def check_tools(messages: list[dict], rid: str) -> None:
    """Refuse tool calling in one line naming the turn: a tool / function role, or an assistant turn that carries
    tool_calls (or the older function_call). A conversation of demonstrations is text turns only."""
    for i, m in enumerate(messages):
        role = m.get("role")
        field = next((f for f in TOOL_FIELDS if m.get(f)), None)
        if role in TOOL_ROLES or field is not None:
            what = f"role {role!r}" if role in TOOL_ROLES else f"an assistant turn with {field}"
            raise RequestError(f"request {rid!r}: field 'messages[{i}]': {what}: tool calls are not supported (the "
                               f"conversation is the few-shot prompt: {SHAPE}, text only)")


def check_names(messages: list[dict], rid: str) -> None:
    """Refuse a participant's `name` in one line naming the turn: the chat template renders roles, not names, so it
    would be dropped without a word."""
    for i, m in enumerate(messages):
        if m.get("name") is not None:
            raise RequestError(f"request {rid!r}: field 'messages[{i}].name': participant names are not supported "
                               "(the model's chat template renders roles only, so the name would be dropped); leave "
                               "it out")


def check_shape(messages: list[dict], rid: str) -> list[dict]:
    """[{'role', 'content'}] with roles normalised (developer -> system) and contents as text, in the shape
    system? (user assistant)+ user; anything else (tool calls, images among them) is refused with one line."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError(f"request {rid!r}: field 'messages': must be a list of messages")
    check_tools(messages, rid)
    check_names(messages, rid)
    roles = [ROLES.get(m.get("role"), str(m.get("role"))) for m in messages]
    body = roles[1:] if roles[:1] == ["system"] else roles
    pairs = (len(body) - 1) // 2
    if len(body) < 3 or len(body) % 2 == 0 or body != ["user", "assistant"] * pairs + ["user"]:
        raise RequestError(f"request {rid!r}: field 'messages': expected {SHAPE}; got {', '.join(roles) or 'none'}")
    out = []
    for i, (m, role) in enumerate(zip(messages, roles)):
        text = message_text(m.get("content"), f"request {rid!r}: field 'messages[{i}]'")
        if role == "assistant" and not text:
            raise RequestError(f"request {rid!r}: field 'messages[{i}]': an assistant turn (a demonstrated output) "
                               "must not be empty")
        out.append({"role": role, "content": text})
    return out


def gguf_chat_template(path: str | None) -> str | None:
    """The chat template a GGUF file carries (key tokenizer.chat_template), if any."""
    if not path or Path(path).suffix != ".gguf" or not Path(path).is_file():
        return None
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def chat_template(lm) -> str:
    """The model's chat template: the tokenizer's, else its GGUF file's (read once, kept in lm.extra)."""
    tpl = getattr(lm.tokenizer, "chat_template", None)
    if not tpl:
        if "chat_template" not in lm.extra:
            lm.extra["chat_template"] = gguf_chat_template(lm.extra.get("path"))
        tpl = lm.extra["chat_template"]
    if not tpl:
        raise RequestError(f"model {lm.name!r} has no chat template (neither its tokenizer nor its GGUF file has "
                           "one); use /v1/calibrate with a request in either JSON form")
    return tpl


def render(lm, messages: list[dict], rid: str) -> Request:
    """The Request of a conversation (module docstring): the rendered text, the assistant contents' spans and the
    start of the demonstrations."""
    check_text(messages, f"request {rid!r}", "messages")  # names the turn (the rendered prompt would be named)
    msgs = check_shape(messages, rid)
    tpl = chat_template(lm)

    def text_of(ms: list[dict], generation: bool) -> str:
        return lm.tokenizer.apply_chat_template(ms, chat_template=tpl, tokenize=False,
                                                add_generation_prompt=generation)

    try:
        text = text_of(msgs, True)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja errors, its own checks)
        raise RequestError(f"request {rid!r}: field 'messages': the model's chat template failed: {exc}") from None
    spans, starts, pos = [], [], 0
    for i, m in enumerate(msgs):
        if m["role"] == "system":
            continue
        try:  # the turn's content follows what the template renders before it (when that is a prefix of the whole)
            head = text_of(msgs[:i], m["role"] == "assistant") if i else ""
        except Exception:  # noqa: BLE001 - some templates refuse a partial conversation
            head = ""
        at = text.find(m["content"], max(len(head) if text.startswith(head) else 0, pos))
        if at < 0:
            raise RequestError(f"request {rid!r}: field 'messages[{i}]': the chat template does not keep this turn's "
                               "content as it is, so its tokens cannot be located")
        starts.append(at)
        if m["role"] == "assistant":
            spans.append((at, at + len(m["content"])))
        pos = at + len(m["content"])
    demos_start = starts[0]  # the first user turn's content
    return Request(id=rid, prompt=text, output_spans=tuple(spans), demos_start=demos_start)


class StreamCut:
    """Deltas of a streamed answer: push(text) takes the whole decoded text so far and returns what can be sent
    now, so that the deltas add up to `cut_at_stops(final text, stops)`: a tail that may begin a stop string, an
    unfinished character (U+FFFD) or trailing whitespace is held back until the next token settles it."""

    def __init__(self, stops) -> None:
        self.stops = [s for s in stops if s]
        self.sent = ""

    def settled(self, text: str) -> str:
        body = cut_at_stops(text, self.stops)
        if len(body) == len(text.strip()):  # no stop string yet: hold back what one could still begin with
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            body = text.lstrip()[:len(text.lstrip()) - hold] if hold else body
        return body.rstrip("\ufffd").rstrip()

    def push(self, text: str) -> str:
        now = self.settled(text)
        if not now.startswith(self.sent):
            return ""
        delta, self.sent = now[len(self.sent):], now
        return delta

    def finish(self, answer: str) -> str:
        """The rest of the final answer (empty when everything was sent)."""
        return answer[len(self.sent):] if answer.startswith(self.sent) else ""


__all__ = ["render", "check_shape", "check_tools", "message_text", "chat_template", "StreamCut", "ROLES", "SHAPE"]
