"""Typed exceptions carrying libladen's message.

Every C status maps to one class; each class also derives from the builtin
exception a Python user would catch for that kind of failure (ValueError for
a malformed file, FileNotFoundError, MemoryError, ...)."""

from __future__ import annotations


class LadenError(Exception):
    """Base of every laden error.  ``status`` is the C status name
    (``"E_SHAPE"``), ``code`` its value; ``str(err)`` is the detail that
    names the file, tensor, field or driver call."""

    def __init__(self, message: str, status: str = "", code: int = 0):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code

    def __str__(self) -> str:  # KeyError would otherwise print a repr
        return self.message


class FormatError(LadenError, ValueError):
    """The checkpoint or its index is malformed, or changed on disk while
    laden used it (status ``E_CHANGED``)."""


class CheckpointNotFoundError(LadenError, FileNotFoundError):
    """A checkpoint file or shard does not exist."""


class ReadError(LadenError, OSError):
    """Reading a file failed (I/O error)."""


class TensorNotFoundError(LadenError, KeyError):
    """No tensor of that name in the checkpoint."""


class OutOfMemoryError(LadenError, MemoryError):
    """Host or device memory ran out."""


class BudgetError(OutOfMemoryError):
    """A byte budget given to laden would be exceeded."""


class DeviceError(LadenError, RuntimeError):
    """The device or its driver failed, or does not exist."""


class InvalidArgumentError(LadenError, ValueError):
    """A call was given an argument it cannot use."""


class StateError(LadenError, RuntimeError):
    """An object was used in a state that does not allow the call."""


class MismatchError(LadenError, ValueError):
    """The checkpoint's tensors do not match the model's: ``missing`` lists
    model tensors the checkpoint lacks, ``unexpected`` checkpoint tensors
    the model lacks, ``mismatched`` tensors whose shape or dtype differ."""

    def __init__(self, message, missing=(), unexpected=(), mismatched=()):
        super().__init__(message, "E_INVAL")
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


BY_STATUS = {
    "E_INVAL": InvalidArgumentError,
    "E_NOMEM": OutOfMemoryError,
    "E_IO": ReadError,
    "E_NOENT": CheckpointNotFoundError,
    "E_TRUNCATED": FormatError,
    "E_HEADER": FormatError,
    "E_JSON": FormatError,
    "E_SCHEMA": FormatError,
    "E_DTYPE": FormatError,
    "E_SHAPE": FormatError,
    "E_RANGE": FormatError,
    "E_NAME": FormatError,
    "E_LIMIT": FormatError,
    "E_INDEX": FormatError,
    "E_NOTFOUND": TensorNotFoundError,
    "E_DEVICE": DeviceError,
    "E_NODEVICE": DeviceError,
    "E_DEVICE_NOMEM": OutOfMemoryError,
    "E_BUDGET": BudgetError,
    "E_UNSUPPORTED": DeviceError,
    "E_STATE": StateError,
    "E_CHANGED": FormatError,
    "E_CORRUPT": FormatError,
}
