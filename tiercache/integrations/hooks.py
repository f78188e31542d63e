"""How a ``TieredCache`` sees a model's passes: hooks on the model's decoder (the module whose
forward takes the token ids and the cache, whichever way the model is called) and a check
in front of ``model.generate`` (the one place that sees a prompt's whole ids).

The pre-hook binds a call's positional arguments to the decoder forward's parameter names
(``inspect.signature``, once per module), so the cache sees exactly what the same call by
keyword gives it (``decoder(ids, mask, positions, cache)`` is ``decoder(input_ids=ids,
attention_mask=mask, position_ids=positions, cache=cache)``).

The hooks are module-level functions and ``generate``'s check is a method bound to the model
(``types.MethodType``), so a deep copy of the model checks itself, and pickling drops the
check (the reloaded model is refused until ``use_tiercache`` readies it again) instead of
failing. A cache is recognised by its ``TIERED_CACHE`` class attribute (this module does
not import the cache).
"""

from __future__ import annotations

import inspect
import types
import weakref
from typing import Any

import torch

from tiercache.errors import UserError

from .inputs import text_config
from .layer import forget_stage

__all__ = ["TIERED_CACHE", "install", "installed"]

#: Class attribute that marks a ``TieredCache``.
TIERED_CACHE = "_is_tiered_cache"
_CACHE_KWARGS = ("cache", "past_key_values")  # the cache's keyword, in transformers 5 and before
# Each hooked module's forward signature (None: not inspectable), computed at its first pass.
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(model: Any) -> None:
    """Hooks the model's decoder (pass begin and end) and its ``generate`` (the prompt
    check), where not hooked yet."""
    decoder = decoder_of(model)
    if not _hooked(decoder):
        decoder.register_forward_pre_hook(_begin_pass, with_kwargs=True)
        decoder.register_forward_hook(_end_pass, with_kwargs=True)
    if not _generate_checked(model):
        model.generate = types.MethodType(_checked_generate, model)


def installed(model: Any) -> bool:
    """Whether ``install`` readied this very model (not a copy that lost its check)."""
    return _hooked(decoder_of(model)) and _generate_checked(model)


def decoder_of(model: Any) -> torch.nn.Module:
    """The module whose forward takes the ids and the cache (the language model's decoder)."""
    getter = getattr(model, "get_decoder", None)
    decoder = getter() if callable(getter) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def _hooked(module: torch.nn.Module) -> bool:
    return any(hook is _begin_pass for hook in module._forward_pre_hooks.values())


def _generate_checked(model: Any) -> bool:
    bound = vars(model).get("generate")
    return isinstance(bound, types.MethodType) and bound.__func__ is _checked_generate and bound.__self__ is model


def _cache_of(args: tuple, kwargs: dict):
    """The ``TieredCache`` a call was given, by keyword or by position; None if none."""
    given = [kwargs.get(name) for name in _CACHE_KWARGS] + list(args)
    return next((value for value in given if getattr(type(value), TIERED_CACHE, False)), None)


def _ids_of(args: tuple, kwargs: dict, names: tuple[str, ...]) -> torch.Tensor | None:
    """The token ids of a call: the first of ``names`` given, else an integer first argument."""
    for name in names:
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    first = args[0] if args else None
    return first if isinstance(first, torch.Tensor) and not first.is_floating_point() else None


def _signature(module: torch.nn.Module) -> inspect.Signature | None:
    """The signature of ``module.forward``, computed once per module; None when it cannot
    be inspected."""
    if module not in _SIGNATURES:
        try:
            _SIGNATURES[module] = inspect.signature(module.forward)
        except (TypeError, ValueError):
            _SIGNATURES[module] = None
    return _SIGNATURES[module]


def _by_name(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments as the same call by keyword gives them: ``(unnamed, named)``, where
    ``named`` maps each given parameter of ``module.forward`` (positional ones bound to their
    names, ``**kwargs`` merged in) to its value and ``unnamed`` holds what a ``*args`` took.
    A call that does not fit the signature (the forward will raise for it) or a forward that
    cannot be inspected is returned as given."""
    return _bind(_signature(module), args, kwargs)


def _bind(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``_by_name`` for a call of ``signature`` (None: cannot be inspected)."""
    try:
        bound = signature.bind_partial(*args, **kwargs) if signature is not None else None
    except TypeError:
        bound = None
    if bound is None:
        return args, kwargs
    unnamed, named = (), {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            unnamed = value
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return unnamed, named


def _begin_pass(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the decoder: hands the pass's inputs, by name (``_by_name``), to
    its ``TieredCache``; forgets the layer an earlier pass left staged (``forget_stage``)."""
    forget_stage()
    args, kwargs = _by_name(module, args, kwargs)
    cache = _cache_of(args, kwargs)
    if cache is not None:
        cache.begin_pass(module, _ids_of(args, kwargs, ("input_ids",)), kwargs)


def _end_pass(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Forward hook of the decoder: the pass finished."""
    cache = _cache_of(args, kwargs)
    if cache is not None:
        cache.end_pass()


def _checked_generate(self, *args, **kwargs):
    """``generate`` of a readied model: first checks its inputs against a ``TieredCache``'s
    prompt (``TieredCache.check_prompt``), then runs the model class's ``generate``."""
    cache = _cache_of((), kwargs)
    if cache is not None:
        unnamed, named = _bind(_generate_signature(self), args, kwargs)  # generation_config given second, say
        ids = _ids_of(unnamed, named, ("input_ids", "inputs"))
        cache.check_prompt(ids, named.get("attention_mask"), named)
    else:
        _refuse_other_caches(self, args, kwargs)
    return type(self).generate(self, *args, **kwargs)


def _refuse_other_caches(model: Any, args: tuple, kwargs: dict) -> None:
    """Refuses, before anything runs, a generate without a ``TieredCache`` of a model that
    attends with tiercache: its first pass would be refused deep in the model, by a message
    that cannot name what the call gave instead (another cache, ``cache_implementation``,
    ``use_cache=False``, or nothing)."""
    from .checks import ATTENTION  # checks imports this module

    if getattr(text_config(model.config), "_attn_implementation", None) != ATTENTION:
        return  # the user switched the attention back: transformers' caches are theirs to use
    _, named = _bind(_generate_signature(model), args, kwargs)  # generation_config given second, say
    config = named.get("generation_config") or getattr(model, "generation_config", None)
    implementation = named.get("cache_implementation", getattr(config, "cache_implementation", None))
    given = next((f"{name}={type(named[name]).__name__}" for name in _CACHE_KWARGS if named.get(name) is not None), None)
    if given is None and implementation is not None:
        given = f"cache_implementation={implementation!r} (a cache transformers makes)"
    if given is None:
        given = "use_cache=False" if named.get("use_cache", getattr(config, "use_cache", True)) is False else "no cache"
    raise UserError(f"generate: a model readied with use_tiercache attends with {ATTENTION!r}, which reads its KV from "
                    f"a TieredCache: pass cache=TieredCache(kv, model) (the call gave {given}; an assistant_model "
                    "readied with use_tiercache cannot be given one, as transformers makes its cache: give it a plain "
                    "model); nothing was run")


def _generate_signature(model: Any) -> inspect.Signature | None:
    """The signature of the model class's ``generate`` as a method of ``model`` (no ``self``);
    None when it cannot be inspected."""
    try:
        return inspect.signature(type(model).generate.__get__(model))
    except (TypeError, ValueError, AttributeError):
        return None


_checked_generate.__name__ = "generate"  # pickled as getattr(model, "generate"): the class's, unchecked
