"""Image inputs: base64 data URLs, or paths inside the configured roots; checked for bytes, pixels and decodability
before anything else sees them. Remote URLs are never fetched (the server would become a proxy into its own network).
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from serve.config import Limits
from serve.protocol import APIError

DATA_URL_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")


def load_image(url: str, limits: Limits, param: str):
    """The image `url` names, as an RGB PIL image; APIError(400) says what is wrong with it otherwise."""
    if url.startswith("data:"):
        data = _decode_data_url(url, limits, param)
    elif url.startswith(("http://", "https://")):
        raise APIError(400, "remote image URLs are not fetched; send the image as a base64 data URL "
                            "(data:image/png;base64,...) or a path under the server's image roots", param=param)
    else:
        data = _read_allowed_path(url, limits, param)
    return _decode_image(data, limits, param)


def _decode_data_url(url: str, limits: Limits, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    mime = header[len("data:"):].split(";")[0].lower()
    if not sep or not header.endswith(";base64"):
        raise APIError(400, "image data URLs must be base64: data:image/<type>;base64,<data>", param=param)
    if mime not in DATA_URL_TYPES:
        raise APIError(400, f"image type {mime or '(none)'} is not accepted; use one of {', '.join(DATA_URL_TYPES)}",
                       param=param)
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise APIError(400, f"image is larger than {limits.max_image_bytes} bytes", param=param, code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "image data URL is not valid base64", param=param, code="invalid_image") from None


def _read_allowed_path(url: str, limits: Limits, param: str) -> bytes:
    """A file:// URL or plain path, resolved (symlinks and '..' included) and required to lie under an image root."""
    parsed = urlparse(url)
    if parsed.scheme not in ("", "file"):
        raise APIError(400, f"image URL scheme {parsed.scheme}: is not accepted", param=param)
    raw = unquote(parsed.path) if parsed.scheme == "file" else url
    if not limits.image_roots:
        raise APIError(400, "this server accepts no image paths (no image roots are configured); send a data URL",
                       param=param)
    path = Path(raw).resolve()
    if not any(path.is_relative_to(root) for root in limits.image_roots):
        raise APIError(400, "image path is outside the allowed image roots", param=param, code="path_not_allowed")
    if not path.is_file():
        raise APIError(400, "image path does not name a file", param=param)
    if path.stat().st_size > limits.max_image_bytes:
        raise APIError(400, f"image is larger than {limits.max_image_bytes} bytes", param=param, code="image_too_large")
    return path.read_bytes()


def _decode_image(data: bytes, limits: Limits, param: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header only: the size is known before decoding
            width, height = header.size
            if width * height > limits.max_image_pixels:
                raise APIError(400, f"image has {width}x{height} pixels, more than {limits.max_image_pixels}",
                               param=param, code="image_too_large")
            header.load()
            return header.convert("RGB")
    except Image.DecompressionBombError:  # PIL's own bound, raised on opening a header claiming > 179M pixels
        raise APIError(400, f"image has more than {limits.max_image_pixels} pixels", param=param,
                       code="image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise APIError(400, "image could not be decoded", param=param, code="invalid_image") from None
