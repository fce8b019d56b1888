"""The chat template compiled and rendered the way `transformers`' `apply_chat_template` does
(`compile_template`), and whether it takes a message's content as parts
(`detect_content_format`).

jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`, `loopcontrols`,
the `{% generation %}` tag, a `tojson` that keeps non-ASCII, `raise_exception`, `strftime_now`,
and a `namespace` that refuses underscore names. jinja2 is imported when a template is
compiled, never by importing this module."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Literal

from pylon.tokenize.errors import TemplateError, TokenizerError, TokenizerUnavailable, one_line

if TYPE_CHECKING:
    from jinja2 import nodes

__all__ = ["ContentFormat", "compile_template", "detect_content_format"]

# How the engine hands a message's content to the template: a string, or a list of parts.
ContentFormat = Literal["string", "openai"]
# Template keywords SGLang takes for the "openai" content format without looking further.
_MEDIA_WORDS: Final = ("image", "audio", "video", "vision")


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "3.1.6" -> (3, 1, 6), "3.2rc1" -> (3, 2)."""
    return tuple(int(m.group()) for p in text.split(".")[:3] if (m := re.match(r"\d+", p)))


def compile_template(source: str) -> tuple[Callable[..., str], ContentFormat]:
    """The template compiled the way transformers compiles it, and its content format."""
    try:
        import jinja2
        from jinja2 import nodes as jinja_nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2.utils import Namespace
    except ImportError:
        raise TokenizerUnavailable("jinja2") from None
    if _version(jinja2.__version__) < (3, 1, 6):
        # As transformers: older jinja2 has known sandbox escapes, and templates are code.
        raise TokenizerError(
            f"jinja2 {jinja2.__version__} is too old to render chat templates safely: "
            "install jinja2>=3.1.6"
        )

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): its
        body, rendered as is."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja_nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    class GuardedNamespace(Namespace):
        """A template `namespace()` that stores no underscore-prefixed names."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            Namespace.__setitem__(self, name, value)

    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: object,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = GuardedNamespace
    try:
        template = env.from_string(source)
        tree = env.parse(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {one_line(exc)}") from None
    content_format = detect_content_format(source, tree)

    def render(**context: Any) -> str:
        try:
            return str(template.render(**context))
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {one_line(exc)}") from None

    return render, content_format


def detect_content_format(source: str, tree: nodes.Template) -> ContentFormat:
    """ "openai" when the template may iterate over a message's content (vLLM and SGLang then
    pass content as a list of parts), else "string". Errs towards "openai": a loop over anything
    that reads a `content` member (through filters, tests, slices, or a variable set from one),
    and SGLang's shortcut (the template mentions images, audio, video or vision)."""
    from jinja2 import nodes as jinja_nodes

    if any(word in source for word in _MEDIA_WORDS):
        return "openai"

    def walk(node: jinja_nodes.Node) -> Iterator[jinja_nodes.Node]:
        yield node
        yield from node.find_all(jinja_nodes.Node)

    def reads_content(node: jinja_nodes.Node, names: set[str]) -> bool:
        for item in walk(node):
            if isinstance(item, jinja_nodes.Getattr) and item.attr == "content":
                return True
            if (
                isinstance(item, jinja_nodes.Getitem)
                and isinstance(item.arg, jinja_nodes.Const)
                and item.arg.value == "content"
            ):
                return True
            if isinstance(item, jinja_nodes.Name) and item.name in names:
                return True
        return False

    # Variables set from a content read ({% set c = message['content'] %}), to a fixed point.
    tainted: set[str] = set()
    assigns = [
        (assign.node, [n.name for n in walk(assign.target) if isinstance(n, jinja_nodes.Name)])
        for assign in tree.find_all(jinja_nodes.Assign)
    ]
    changed = True
    while changed:
        changed = False
        for value, targets in assigns:
            fresh = [name for name in targets if name not in tainted]
            if fresh and reads_content(value, tainted):
                tainted.update(fresh)
                changed = True
    for loop in tree.find_all(jinja_nodes.For):
        if reads_content(loop.iter, tainted):
            return "openai"
    return "string"
