"""Faster Triton interpreter runs on the CPU: patch triton.language once per kernel launch.

The interpreter patches triton.language for each launch (and restores it afterwards), then patches
it again for every call of a @triton.jit helper inside the kernel, program after program: each
call scans the language modules with inspect.getmembers and installs the same replacements again.
Within one launch, once a language module (triton.language, triton.language.core) is patched,
patching it again changes nothing, so this patches each module once per launch: the first helper
that sees a module the launch has not patched yet patches it as before; later ones skip it. Every
kernel's results stay as they were; about a third of the interpreted time goes.
"""

from __future__ import annotations

import inspect

_INSTALLED = False


def install():
    """Idempotent; only affects runs under TRITON_INTERPRET=1 (the patched path is the interpreter's)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton import language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None:  # another Triton layout: leave it alone
        return
    active = []  # the language modules patched in the launch in progress (launches do not nest)
    seen = {}  # fn -> the language modules its globals hold

    def langs_of(fn):
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core))
        return langs

    def patch_lang(fn):
        langs = langs_of(fn)
        if active:  # a helper called inside a launch
            if langs and langs <= active[-1]:
                return scope_class()  # already patched in this launch; nothing to restore
            scope = original(fn)  # e.g. triton.language.standard's helpers, which see triton.language.core
            active[-1] |= langs
            return scope
        scope = original(fn)
        restore = getattr(scope, "restore", None)
        if restore is None:  # another Triton layout: this launch runs as the interpreter has it
            return scope
        active.append(langs)

        def restore_and_leave():
            active.pop()
            restore()

        scope.restore = restore_and_leave
        return scope

    interpreter._patch_lang = patch_lang
    _INSTALLED = True
