"""Silence notices from torch and torchao that every pgc command would print and that no pgc
user can act on. Imported first by ``compiler``."""

import logging
import warnings

_NOISE = (
    # torch 2.13 logs a deprecation notice for each enum torchao registers on import
    "is an Enum subclass and is now natively supported",
    # torchao's CUDA-only extensions (mxfp8, CUTLASS) that pgc does not use fail to load on CPU
    "_C_mxfp8",
    "_C_cutlass",
)


def _drop_import_noise(record: logging.LogRecord) -> bool:
    """Notices printed by every import of torchao that no pgc user can act on."""
    text = str(record.msg) if not record.args else record.getMessage()
    return not any(n in text for n in _NOISE)


for _logger in ("torch.utils._pytree", "torchao"):
    logging.getLogger(_logger).addFilter(_drop_import_noise)
# Inductor's oneDNN int8 lowering copies a tensor in a way torch itself warns about
warnings.filterwarnings(
    "ignore", message="To copy construct from a tensor", module="torch._inductor.mkldnn_lowerings"
)


class _RecompileLimit(logging.Filter):
    """Dynamo's warning that a compiled function hit its recompile limit (a static-shape
    variant fed a new length for the ninth time; it runs eagerly from then on), counted and
    kept off the terminal where :func:`silence_recompile_limit` installed it."""

    hits = 0
    last = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if "hit config." not in str(record.msg):
            return True
        _RecompileLimit.hits += 1
        try:
            _RecompileLimit.last = record.getMessage().splitlines()[2].strip()
        except (IndexError, TypeError):
            _RecompileLimit.last = ""
        return False


_LIMIT = _RecompileLimit()


def silence_recompile_limit() -> None:
    """Count Dynamo's recompile-limit warning (:func:`recompile_limit_hits`) instead of
    printing it. For pgc's own search processes (a search reports it as the trial's result);
    never installed in a serving process, whose own ``torch.compile`` warnings are its user's."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _LIMIT not in logger.filters:
        logger.addFilter(_LIMIT)


def recompile_limit_hits() -> tuple[int, str]:
    """How many times a compiled function of this process hit Dynamo's recompile limit since
    :func:`silence_recompile_limit`, and the last one's reason (``last reason: ... size
    mismatch at index 1 ...``)."""
    return _RecompileLimit.hits, _RecompileLimit.last
