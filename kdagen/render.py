"""Variant -> CuTe-DSL module source, through the Jinja templates in ``templates/``."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import jinja2

from kdagen.serve.fingerprint import dsl_version
from kdagen.serve.resources import data_dir
from kdagen.serve.variant import Variant

TEMPLATE_DIR = Path(os.environ.get("KDAGEN_TEMPLATES", data_dir("templates")))


@functools.cache
def environment() -> jinja2.Environment:
    """StrictUndefined: a template that reads a field the variant lacks fails to render."""
    if not TEMPLATE_DIR.is_dir():
        raise FileNotFoundError(
            f"kdagen templates not found at {TEMPLATE_DIR}; install kdagen from its checkout "
            "(pip install -e .) or set KDAGEN_TEMPLATES"
        )
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _context(variant: Variant) -> dict[str, object]:
    """Values the templates read besides the variant itself, derived once here."""
    context: dict[str, object] = {
        "variant": variant,
        "template_path": variant.spec.template,
        "softplus": variant.gate == "softplus",
    }
    if variant.kernel == "verify":
        context["conv"] = variant.conv
        context["conv_dim_first"] = variant.conv and variant.conv_layout == "dim_first"
        context["conv_f32"] = variant.conv and variant.conv_weight_dtype == "fp32"
    return context


@functools.cache
def render(variant: Variant) -> str:
    """The variant's kernel module as Python source."""
    return environment().get_template(variant.spec.template).render(**_context(variant))


@functools.cache
def helpers_source() -> bytes:
    """The device helpers rendered kernels import (kdagen/dsl): part of every digest."""
    root = Path(__file__).resolve().parent / "dsl"
    return b"".join(path.read_bytes() for path in sorted(root.glob("*.py")))


def digest(variant: Variant) -> str:
    """Content hash: the rendered source, the device helpers it imports and the DSL version
    that compiles it."""
    h = hashlib.sha256()
    h.update(render(variant).encode())
    h.update(b"\0helpers\0" + helpers_source())
    h.update(b"\0nvidia-cutlass-dsl=" + dsl_version().encode())
    return h.hexdigest()[:16]


def kernels_digest(names: Iterable[str]) -> str:
    """Hash of the content digests (``digest``) of a set of variants. A dispatch table records
    it for the variants it measured, so a template edit that renders those kernels
    identically leaves the table fresh."""
    h = hashlib.sha256()
    for name in sorted(set(names)):
        h.update(f"{name}\0{digest(Variant.parse(name))}\n".encode())
    return h.hexdigest()[:16]


def template_digest(kernel: str | None = None) -> str:
    """Hash of every template file (of one kernel, or all): dispatch tables record it."""
    h = hashlib.sha256()
    root = TEMPLATE_DIR
    for path in sorted(root.rglob("*.j2")):
        rel = path.relative_to(root).as_posix()
        if kernel is None or rel.startswith((f"{kernel}/", "common/")):
            h.update(rel.encode() + b"\0" + path.read_bytes())
    h.update(helpers_source())
    return h.hexdigest()[:16]
