"""Chat messages -> prompt token ids, through a chat template.

The template is the tokenizer's own (`tokenizer.chat_template`, what vLLM uses) when it has
one; otherwise `DEFAULT_CHAT_TEMPLATE`, a plain transcript:

    system: You are terse.
    user: Hi!
    assistant:

(one `role: content` line per message, and `assistant:` when a reply is asked for). The
template runs in transformers' sandboxed Jinja environment (`apply_chat_template`); the text
it writes is tokenized without adding special tokens again (the template writes them).
"""
from __future__ import annotations

from typing import Any

from graphmode.decode.output import encode_text
from graphmode.serve.errors import BadRequest

DEFAULT_CHAT_TEMPLATE = ("{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{%- if add_generation_prompt %}assistant:{% endif %}")


def chat_template(tokenizer: Any) -> str:
    """The template the server renders chats with: the tokenizer's, else the default."""
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own.strip() else DEFAULT_CHAT_TEMPLATE


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
           continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt's token ids. A template that fails on these messages (many refuse a role
    order, e.g. two user messages in a row) is the client's 400, with the template's words.
    `continue_final_message` leaves the last message open (no end-of-turn after it);
    `template_kwargs` are extra variables the template reads."""
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template(tokenizer), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja's errors (raise_exception in the template, undefined names)
        raise BadRequest(f"the chat template refused these messages: {str(e)[:300]}", reason="chat_template",
                         where="messages", fix="send the roles in the order the model's template expects") from None
    return encode_text(tokenizer, text, "messages", add_special_tokens=False)
