"""The SGLang version gate and the table of what is wired, per SGLang version.

Everything this plugin touches inside SGLang was read from the releases in ``SUPPORTED_VERSIONS``:
the plugin loader (``sglang.srt.plugins``), ``ServerArgs.add_cli_args`` / ``from_cli_args``, the
radix-cache registry, the attention registry and its CLI choices, ``KVCacheConfigurator``'s pool
builders, and the prefix-cache API (``MatchPrefixParams``, ``InsertParams``, ``EvictParams``,
``checkpoint``, lock receipts). SGLang changes these between releases, so any other version is
refused: the plugin then installs nothing and SGLang runs natively, with a logged error saying
why. ``KVPLUG_SGLANG_ALLOW_UNTESTED=1`` installs anyway, for people porting the plugin.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from typing import Mapping

from kvplug.host_internals import ASSIGNED, PARAMETERS, SOURCE, HostInternal
from kvplug.interface import KVPlugError

logger = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("0.5.23",)
ALLOW_UNTESTED_ENV = "KVPLUG_SGLANG_ALLOW_UNTESTED"
INSTALL_HINT = "pip install sglang==0.5.23"

#: What the plugin wires into each supported SGLang release (the README's table is this one).
WIRED: Mapping[str, Mapping[str, str]] = {
    "0.5.23": {
        "--kv-backend / --prefix-cache / --kvplug-attention": "yes (ServerArgs.add_cli_args + from_cli_args hooks)",
        "kvplug prefix caches as --radix-cache-backend kvplug:NAME": "yes, full-attention models",
        "attention backend kvplug[:NAME]": "yes, extend/decode/mixed eagerly; decode also in CUDA graphs",
        "KV pool (MHA) storage from kvplug": "yes (KVCacheConfigurator._resolve_kv_pool_class hook)",
        "req-to-token table with kvplug's dummy row": "yes (KVCacheConfigurator._build_default_req_pool hook)",
        "decode CUDA graphs with kvplug attention": (
            "yes, SGLang's 'full' decode graphs (init_cuda_graph_state, get_cuda_graph_seq_len_fill_value, "
            "init_forward_metadata_out_graph; padded slots are kvplug's dummy request); 'breakable' refused"
        ),
        "prefill (extend) CUDA graphs with kvplug attention": "no: --kv-backend kvplug sets them disabled",
        "hybrid SWA / Mamba / MLA / hierarchical cache / EAGLE bigram keys / FP8 KV": "no: refused with an error",
        "prefix-cache quarantine record in /server_info": (
            "yes (hook after SchedulerInternalStateController.get_internal_state)"
        ),
        "prefix-cache quarantine in /health": (
            "yes (hook after TokenizerManager.__init__ puts health.QuarantineHealth on the HTTP app; "
            "it reads TokenizerManager.get_internal_state)"
        ),
        "KV-event batches numbered from the start time, each new subscriber answered (a router sees a restart)": (
            "yes, with a kvplug tree cache (hook around SchedulerKvEventsPublisher.init_kv_events picks "
            "answering_publisher's registered ZMQ publisher)"
        ),
        "--enable-memory-saver": "no: kvplug's pool is allocated outside SGLang's memory-saver region",
    },
}

#: SGLang internals the plugin hooks, calls or relies on, pinned to 0.5.23 (``kvplug.host_internals``):
#: ``tests/test_sglang_compat_internals.py`` recomputes them, so a release that changes one is seen.
#: (The pool, registry and prefix-cache names above predate this table and are covered by the tests
#: that drive them.)
INTERNALS: tuple[HostInternal, ...] = (
    HostInternal("sglang.srt.managers.tokenizer_manager.TokenizerManager", "__init__", "hooked",
                 "after it, the HTTP process's /health gets the quarantine middleware (health.py)",
                 PARAMETERS, "self, server_args, port_args, start_pd_bootstrap_service"),
    HostInternal("sglang.srt.managers.tokenizer_manager.TokenizerManager", "get_internal_state", "called",
                 "/health reads the schedulers' internal states, the quarantine record among them",
                 PARAMETERS, "self"),
    HostInternal("sglang.srt.entrypoints.http_server", "health_generate", "wrapped",
                 "its 200 (empty) is what QuarantineHealth turns into kvplug's degraded answer; "
                 "the module's FastAPI `app` gets the middleware", SOURCE, "4770bf2e87bb8a5a"),
    HostInternal("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController",
                 "get_internal_state", "hooked", "after it, a rank's state carries the quarantine record",
                 PARAMETERS, "self, recv_req"),
    HostInternal("sglang.srt.managers.scheduler_components.kv_events_publisher.SchedulerKvEventsPublisher",
                 "init_kv_events", "hooked", "around it, a kvplug tree cache's \"zmq\" config names "
                 "answering_publisher's publisher", PARAMETERS, "self, kv_events_config"),
    HostInternal("sglang.srt.disaggregation.kv_events.EventPublisherFactory", "register_publisher", "called",
                 "registers answering_publisher.AnsweringZmqEventPublisher as \"kvplug-zmq\"",
                 PARAMETERS, "cls, name, ctor"),
    HostInternal("sglang.srt.disaggregation.kv_events.EventPublisherFactory", "create", "read",
                 "builds the registered publisher with the config's fields as keyword arguments",
                 SOURCE, "c60213a91c2d5106"),
    HostInternal("sglang.srt.managers.scheduler.Scheduler", "_prefetch_kvcache", "hooked",
                 "after it (SGLang calls it for a request just before its waiting queue), a kvplug tree cache "
                 "starts the shared KV store's prefetch of the prompt (KvplugPrefixCache.prefetch, issue 30)",
                 PARAMETERS, "self, req, storage_hit_end"),
    HostInternal("sglang.srt.disaggregation.kv_events.ZmqEventPublisher", "_seq_gen", "replaced",
                 "the batch counter event_sequence.number_from_start_time restarts at the start time",
                 ASSIGNED, "self._seq_gen set by the class"),
    HostInternal("sglang.srt.disaggregation.kv_events.ZmqEventPublisher", "__init__", "read",
                 "makes _event_queue, then _socket_setup, then _seq_gen (an itertools.count), then the thread",
                 SOURCE, "51f9614cf02f95ad"),
    HostInternal("sglang.srt.disaggregation.kv_events.ZmqEventPublisher", "_socket_setup", "overridden",
                 "AnsweringZmqEventPublisher makes an XPUB where it makes a PUB (it skips a set _pub) and "
                 "binds by its rule", SOURCE, "8fef07986d6e466c"),
    HostInternal("sglang.srt.disaggregation.kv_events.ZmqEventPublisher", "_publisher_thread", "read",
                 "takes every batch with _event_queue.get on the socket's thread, numbers, sends and buffers it "
                 "(AnsweringQueue answers subscriptions there)", SOURCE, "102dda84119ace07"),
)


class UnsupportedSGLangError(KVPlugError, ImportError):
    """SGLang is missing, or its version is not one the plugin was written for."""


def installed_sglang_version() -> str | None:
    """The installed SGLang distribution's version, or ``None`` when SGLang is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def is_supported(version: str | None) -> bool:
    return version in SUPPORTED_VERSIONS


def untested_allowed(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ALLOW_UNTESTED_ENV, "") not in ("", "0")


def require_supported_sglang(version: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Return the SGLang version if the plugin may install into it, else raise.

    Raises:
        UnsupportedSGLangError: SGLang is not installed, or its version is not in
            ``SUPPORTED_VERSIONS`` and ``KVPLUG_SGLANG_ALLOW_UNTESTED`` is not set.
    """
    version = installed_sglang_version() if version is None else version
    if version is None:
        raise UnsupportedSGLangError(f"SGLang is not installed; the kvplug SGLang plugin needs it: {INSTALL_HINT}")
    if is_supported(version):
        return version
    if untested_allowed(env):
        logger.warning(
            "kvplug-sglang: SGLang %s is untested (supported: %s); installing anyway because %s is set",
            version,
            ", ".join(SUPPORTED_VERSIONS),
            ALLOW_UNTESTED_ENV,
        )
        return version
    raise UnsupportedSGLangError(
        f"kvplug-sglang supports SGLang {', '.join(SUPPORTED_VERSIONS)}, found {version}: {INSTALL_HINT} "
        f"(or set {ALLOW_UNTESTED_ENV}=1 to try this version anyway)"
    )
