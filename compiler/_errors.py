"""The compiler's errors. ``compiler`` may not import ``pgc_daemon``, so its root is its own;
the daemon's outer layer maps these to exit codes and HTTP statuses."""


class CompilerError(Exception):
    """Root of every error the compiler raises."""


class RecipeError(CompilerError, ValueError):
    """A recipe (or its JSON) is malformed or asks for something that cannot exist."""


class BuildError(CompilerError, RuntimeError):
    """A valid recipe could not be built for this model on this machine."""


class UnsafeFolderError(CompilerError, PermissionError):
    """A folder pgc loads pickled graphs or generated code from is not private to this user."""


class ArtifactUnavailable(CompilerError, LookupError):
    """A stored artifact cannot be loaded here: missing, corrupt (a file's checksum differs
    from its manifest) or incompatible (built for another model, recipe, machine, library
    version or code-generation setting). The caller builds the variant instead."""


def brief_error(exc: BaseException, limit: int = 300) -> str:
    """``exc`` for a trial's reason or a table cell: its type and the first two lines of its
    message, whitespace collapsed, at most ``limit`` characters. Inductor's lowering errors
    run to hundreds of lines of IR (an int8 ResNet's trial printed 189), and their first line
    alone ("LoweringException: NotImplementedError: Pointwise") does not say which op; the
    second does ("target: mkldnn._linear_pointwise.default")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
    text = " ".join(" ".join(lines).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
