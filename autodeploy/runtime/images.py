"""What a user passes as an image, turned into a checked RGB picture and a digest of its pixels.

A source may be a ``PIL.Image.Image``, the bytes of an encoded file, a local path (or ``file://`` URL), a
``data:image/…;base64,`` URL, or an ``http(s)://`` URL. Every source goes through the same checks — size of the
encoded file, format, pixel count read from the header *before* any pixel is decoded (a small PNG can claim
gigapixels), a full decode so that a truncated file fails here rather than in the vision tower — and comes
out as mode ``"RGB"`` with its EXIF orientation applied. Whatever is wrong raises ``InvalidRequestError``
naming the image's index and what to send instead.

The digest covers only the decoded pixels (mode, size, raw bytes), never a file name, URL or metadata: it
keys the cache of vision-tower outputs, and peers served cached results for the wrong image when keys came
from short hashes or from EXIF fields. Two files that decode to the same pixels share a digest; an EXIF
orientation is applied before hashing, so it is part of the pixels, and other metadata is not.

>>> from PIL import Image
>>> loaded = load_image(Image.new("RGBA", (4, 3)))
>>> loaded.image.mode, loaded.size, len(loaded.digest)
('RGB', (4, 3), 64)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from autodeploy.errors import ConfigError, InvalidRequestError, error_summary

_ACCEPTED_SOURCES = "a PIL.Image.Image, bytes of an encoded file, a local path, or a data:, file://, http:// or https:// URL"
_URL_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# Modes whose alpha (or transparency key) is composited on white, as a viewer shows them.
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa")


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost: bytes on the wire, pixels once decoded, seconds to fetch, accepted formats."""

    max_encoded_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    fetch_timeout_s: float = 10.0
    formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP")


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image, upright, and the blake2b-256 hex digest of its pixels."""

    image: Image.Image
    digest: str

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def load_image(source, *, index: int = 0, limits: ImageLimits = ImageLimits(), local_files: bool | Path = True) -> LoadedImage:
    """Decode, check and convert one image; ``index`` is its position in the request, named in every error.

    ``local_files`` says which paths may be read: ``True`` any (the Python API), ``False`` none (a server's
    default), a directory only files inside it once symlinks and ``..`` are resolved.

    >>> import io
    >>> png = io.BytesIO()
    >>> Image.new("L", (3, 2), 128).save(png, "PNG")
    >>> loaded = load_image(png.getvalue(), index=1)
    >>> loaded.image.getpixel((0, 0)), loaded.size
    ((128, 128, 128), (3, 2))
    """
    if isinstance(source, Image.Image):
        return _finish(source, f"image {index} (PIL image)", limits)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return _decode(data, f"image {index} ({len(data)} bytes)", limits)
    if isinstance(source, os.PathLike):
        return _decode(*_read_local(source, index, limits, local_files), limits)
    if isinstance(source, str):
        if source[:5].lower() == "data:":
            return _decode(*_read_data_url(source, index, limits), limits)
        match = _URL_SCHEME.match(source)
        if match is None:
            return _decode(*_read_local(Path(source), index, limits, local_files), limits)
        scheme = match.group(1).lower()
        if scheme in ("http", "https"):
            return _decode(*_fetch(source, index, limits), limits)
        if scheme == "file":
            return _decode(*_read_local(_file_url_path(source, index), index, limits, local_files), limits)
        raise InvalidRequestError(f"image {index} ({_shorten(source)}): URL scheme {scheme}:// is not supported; send {_ACCEPTED_SOURCES}")
    raise InvalidRequestError(f"image {index}: a {type(source).__name__} is not an image; send {_ACCEPTED_SOURCES}")


def load_images(sources: Sequence, *, limits: ImageLimits = ImageLimits(), local_files: bool | Path = True) -> list[LoadedImage]:
    """``load_image`` on each source, with its position as its index."""
    if isinstance(sources, (str, bytes, bytearray, memoryview, Image.Image)):
        raise InvalidRequestError(f"images must be a list of sources, not one {type(sources).__name__}; wrap it in a list")
    return [load_image(source, index=index, limits=limits, local_files=local_files) for index, source in enumerate(sources)]


def _read_local(path: os.PathLike, index: int, limits: ImageLimits, local_files: bool | Path) -> tuple[bytes, str]:
    name = f"image {index} ({_shorten(os.fspath(path), keep_end=True)})"
    if local_files is False:
        raise InvalidRequestError(f"{name}: local files are not accepted here; send the image's bytes, a data: URL or an http(s) URL")
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, ValueError) as error:  # a NUL byte, a symlink loop
        raise InvalidRequestError(f"{name}: not a usable path ({error}); check the path") from error
    if local_files is not True:
        allowed = Path(local_files).expanduser().resolve()
        if not allowed.is_dir():
            raise ConfigError(f"the directory allowed for local images, {allowed}, is not a directory; create it or name another")
        if not resolved.is_relative_to(allowed):
            raise InvalidRequestError(f"{name}: only files inside {allowed} may be read; move the image there or send its bytes")
    if not resolved.exists():
        raise InvalidRequestError(f"{name}: no such file; check the path")
    if not resolved.is_file():  # a FIFO or device would block or never end
        raise InvalidRequestError(f"{name}: not a regular file; pass the path of an image file")
    try:
        with open(resolved, "rb") as file:
            data = file.read(limits.max_encoded_bytes + 1)
    except OSError as error:
        raise InvalidRequestError(f"{name}: cannot be read ({error.strerror or error}); check its permissions") from error
    return data, name


def _file_url_path(url: str, index: int) -> Path:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"image {index} ({_shorten(url)}): a file:// URL must name a local file (no host); got host {parsed.netloc}")
    return Path(urllib.request.url2pathname(parsed.path))


def _read_data_url(url: str, index: int, limits: ImageLimits) -> tuple[bytes, str]:
    header, comma, payload = url[len("data:") :].partition(",")
    media_type, *parameters = header.split(";")
    name = f"image {index} (data URL, {_shorten(media_type, 40) or 'no media type'})"
    if not comma:
        raise InvalidRequestError(f"{name}: no ',' before the data; write data:image/png;base64,<data>")
    if not media_type.lower().startswith("image/"):
        raise InvalidRequestError(f"{name}: not an image media type; write data:image/<type>;base64,<data>")
    if "base64" not in (parameter.strip().lower() for parameter in parameters):
        raise InvalidRequestError(f"{name}: only base64 data URLs are accepted; write data:{media_type};base64,<data>")
    payload = "".join(payload.split())  # clients wrap long base64 lines
    if len(payload) // 4 * 3 > limits.max_encoded_bytes + 2:  # refuse before decoding what would be too large anyway
        raise _too_large(name, limits)
    try:
        return base64.b64decode(payload, validate=True), name
    except (binascii.Error, ValueError) as error:
        raise InvalidRequestError(f"{name}: the data is not valid base64 ({error}); encode the file with standard base64") from error


def _fetch(url: str, index: int, limits: ImageLimits) -> tuple[bytes, str]:
    """At most ``max_encoded_bytes + 1`` bytes. Each wait for the server is bounded by ``fetch_timeout_s``, and
    so is the whole body: a server dripping one byte at a time would otherwise hold the request for ever."""
    name = f"image {index} ({_shorten(url)})"
    deadline = time.monotonic() + limits.fetch_timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "autodeploy", "Accept": "image/*"})
    try:
        # urlopen follows redirects and raises HTTPError for any other answer outside 2xx
        with urllib.request.urlopen(request, timeout=limits.fetch_timeout_s) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > limits.max_encoded_bytes:
                raise _too_large(name, limits)
            chunks, received = [], 0
            while received <= limits.max_encoded_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = response.read1(min(2**16, limits.max_encoded_bytes + 1 - received))
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
            if declared.isdigit() and received < int(declared):  # read1 ends quietly where the connection did
                raise InvalidRequestError(f"{name}: the connection closed after {received} of {declared} bytes; try again")
    except InvalidRequestError:
        raise
    except urllib.error.HTTPError as error:
        error.close()  # it holds the connection open until collected
        raise InvalidRequestError(f"{name}: the server answered HTTP {error.code} {error.reason}; check the URL") from error
    except (TimeoutError, urllib.error.URLError) as error:
        if isinstance(error, TimeoutError) or isinstance(error.reason, TimeoutError):
            raise InvalidRequestError(f"{name}: no complete answer within {limits.fetch_timeout_s:g} s; use a faster host or send the bytes") from error
        raise InvalidRequestError(f"{name}: cannot connect ({error.reason}); check the URL and that the host is reachable") from error
    except (OSError, ValueError, http.client.HTTPException) as error:  # a connection cut mid-body, a malformed URL
        raise InvalidRequestError(f"{name}: the download failed ({error_summary(error, 200)}); check the URL") from error
    return b"".join(chunks), name


def _decode(data: bytes, name: str, limits: ImageLimits) -> LoadedImage:
    if len(data) > limits.max_encoded_bytes:
        raise _too_large(name, limits)
    try:
        opened = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:  # the warning where raised as an error
        raise InvalidRequestError(f"{name}: {error_summary(error, 200)}; send an image of at most {limits.max_pixels} pixels") from error
    except Image.UnidentifiedImageError as error:
        raise InvalidRequestError(f"{name}: not an image file Pillow recognises (corrupt, or another kind of file); send a file in one of: {_formats(limits)}") from error
    except Exception as error:  # Pillow's parsers raise many types on malformed input
        raise InvalidRequestError(f"{name}: cannot be decoded as an image ({error_summary(error, 200)}); send a complete file in one of: {_formats(limits)}") from error
    with opened:
        found = "JPEG" if opened.format == "MPO" else opened.format  # phones' JPEGs with a preview open as MPO
        if found not in limits.formats:
            raise InvalidRequestError(f"{name}: format {found} is not accepted (accepted: {_formats(limits)}); convert the image to one of them")
        return _finish(opened, name, limits)


def _finish(image: Image.Image, name: str, limits: ImageLimits) -> LoadedImage:
    width, height = image.size  # from the header: nothing decoded yet
    if width == 0 or height == 0:
        raise InvalidRequestError(f"{name}: the image is {width}x{height} pixels, empty; send an image with pixels")
    if width * height > limits.max_pixels:
        raise InvalidRequestError(f"{name}: {width}x{height} is {width * height} pixels, more than the {limits.max_pixels} allowed; downscale it")
    try:
        image.load()  # the full decode: a truncated file fails here (Pillow's LOAD_TRUNCATED_IMAGES stays off)
        upright = ImageOps.exif_transpose(image)
    except Exception as error:
        raise InvalidRequestError(f"{name}: the file is corrupt or truncated ({error_summary(error, 200)}); send the complete file") from error
    rgb = _to_rgb(upright, name)
    digest = hashlib.blake2b(f"{rgb.mode} {rgb.width}x{rgb.height}\n".encode(), digest_size=32)
    digest.update(rgb.tobytes())
    return LoadedImage(rgb, digest.hexdigest())


def _to_rgb(image: Image.Image, name: str) -> Image.Image:
    """RGB as a viewer would show it: transparency over white, 16-bit grey scaled rather than clipped at 255."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode.startswith("I;16") or image.mode == "I":
        # Mode I holds 16-bit samples in practice (PNG, and Pillow before 10 opened 16-bit PNGs as I).
        grey = np.clip(np.asarray(image, dtype=np.float64), 0, 65535) * (255 / 65535)
        return Image.fromarray(np.rint(grey).astype(np.uint8), "L").convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    if image.mode == "F":  # Pillow's convention for F: the 0..255 scale of L
        grey = np.clip(np.asarray(image, dtype=np.float64), 0, 255)
        return Image.fromarray(np.rint(grey).astype(np.uint8), "L").convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError as error:
        raise InvalidRequestError(f"{name}: mode {image.mode} cannot be converted to RGB ({error}); save the image as RGB") from error


def _too_large(name: str, limits: ImageLimits) -> InvalidRequestError:
    return InvalidRequestError(f"{name}: the encoded file is over the {limits.max_encoded_bytes} bytes allowed; compress or downscale it")


def _formats(limits: ImageLimits) -> str:
    return ", ".join(limits.formats)


def _shorten(text: str, limit: int = 80, keep_end: bool = False) -> str:
    """A URL keeps its host, a path its file name."""
    if len(text) <= limit:
        return text
    return "…" + text[1 - limit :] if keep_end else text[: limit - 1] + "…"
