"""Chat messages (and tools) through the model's chat template: the one place generation and
Tokenize render a chat prompt, so both give the same ids.

Refused with :class:`InvalidArgument`, before anything is queued: chat for a model without a chat
template (a base model, e.g. gemma3-270m), and ``tools`` for a template that never reads them
(rendering would silently drop the tools, and the model could not know it may call one).
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import jinja2.meta

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput


def render_chat(
    tokenizer: Any, model_name: str, prompt: PromptInput, *, add_generation_prompt: bool = True,
    tokenize: bool,
) -> Any:
    """``apply_chat_template`` of ``prompt``'s messages and tools: token ids (``tokenize``) or
    the text."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InvalidArgument(
            f"{model_name} has no chat template (a base model): chat messages cannot be "
            "formatted for it; use completions (a plain prompt) instead"
        )
    tools = prompt.template_tools()
    if tools is not None and not reads_tools(_tool_template(template)):
        raise InvalidArgument(
            f"tools: the chat template of {model_name} has no tool support (it never reads "
            "`tools`), so the tools could not reach the model; send the request without tools"
        )
    kwargs: dict[str, Any] = {"tokenize": tokenize}
    if tokenize:
        kwargs["return_dict"] = False
    return tokenizer.apply_chat_template(
        prompt.template_messages(), tools=tools, add_generation_prompt=add_generation_prompt,
        **kwargs,
    )


def _tool_template(template: str | dict[str, str]) -> str:
    """The template transformers picks when tools are given (a named ``tool_use`` one first)."""
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default") or ""
    return template


@functools.lru_cache(maxsize=8)
def reads_tools(template: str) -> bool:
    """True if the Jinja template reads the ``tools`` variable."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "tools" in template  # transformers' own environment parses it; be lenient
    return "tools" in jinja2.meta.find_undeclared_variables(ast)
