"""load_image: every source kind and image mode becomes an upright RGB image with a pixel digest, and every bad
input is refused with an InvalidRequestError naming the image. Images are made here with Pillow and numpy;
URLs are served by a loopback HTTP server started by the tests."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import struct
import threading
import time
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from autodeploy.errors import ConfigError, InvalidRequestError
from autodeploy.runtime.images import ImageLimits, LoadedImage, load_image, load_images


def encode(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    return buffer.getvalue()


def gradient(width: int = 48, height: int = 32) -> Image.Image:
    """Smooth, so that JPEG keeps it within a few levels."""
    x, y = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))
    return Image.fromarray(np.stack([x, y, 255 - x], axis=-1).astype(np.uint8), "RGB")


def noise(width: int = 64, height: int = 64) -> Image.Image:
    """Incompressible, so that the first half of its PNG ends inside the pixel data."""
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def pixels(loaded: LoadedImage) -> np.ndarray:
    return np.asarray(loaded.image, dtype=np.int16)


# --- formats and modes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("format, options", [("PNG", {}), ("WEBP", {"lossless": True})])
def test_lossless_round_trips_keep_every_pixel(format, options):
    original = gradient()
    loaded = load_image(encode(original, format, **options))
    assert loaded.image.mode == "RGB" and loaded.size == (48, 32) and (loaded.width, loaded.height) == (48, 32)
    np.testing.assert_array_equal(np.asarray(loaded.image), np.asarray(original))


def test_jpeg_round_trip_stays_close():
    original = gradient()
    loaded = load_image(encode(original, "JPEG", quality=95))
    assert loaded.image.mode == "RGB" and loaded.size == original.size
    assert np.abs(pixels(loaded) - np.asarray(original, dtype=np.int16)).max() <= 12


def palette_image(transparent_index: int | None = None) -> Image.Image:
    image = Image.new("P", (2, 1))
    image.putpalette([10, 20, 30, 200, 100, 50])
    image.putpixel((1, 0), 1)
    if transparent_index is not None:
        image.info["transparency"] = transparent_index
    return image


def sixteen_bit_grey() -> Image.Image:
    return Image.fromarray(np.array([[0, 128 * 257, 65535]], dtype=np.uint16))


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: Image.new("RGBA", (3, 1), (200, 0, 0, 0)), [(255, 255, 255)] * 3),  # fully transparent → white
        (lambda: Image.new("RGBA", (1, 1), (200, 0, 0, 255)), [(200, 0, 0)]),
        (lambda: Image.new("RGBA", (1, 1), (0, 0, 0, 128)), [(127, 127, 127)]),  # half over white
        (lambda: Image.new("LA", (1, 1), (100, 0)), [(255, 255, 255)]),
        (lambda: Image.new("LA", (1, 1), (100, 255)), [(100, 100, 100)]),
        (lambda: palette_image().convert("PA"), [(10, 20, 30), (200, 100, 50)]),
        (lambda: Image.new("L", (1, 1), 77), [(77, 77, 77)]),
        (lambda: Image.new("1", (2, 1), 1), [(255, 255, 255)] * 2),
        (lambda: palette_image(), [(10, 20, 30), (200, 100, 50)]),
        (lambda: palette_image(transparent_index=1), [(10, 20, 30), (255, 255, 255)]),
        (lambda: Image.new("CMYK", (1, 1), (0, 0, 0, 0)), [(255, 255, 255)]),
        (lambda: Image.new("CMYK", (1, 1), (255, 0, 0, 0)), [(0, 255, 255)]),
        (lambda: Image.new("YCbCr", (1, 1), (128, 128, 128)), [(128, 128, 128)]),
        (sixteen_bit_grey, [(0, 0, 0), (128, 128, 128), (255, 255, 255)]),
        (lambda: Image.fromarray(np.array([[0, 65535, 70000]], dtype=np.int32)), [(0, 0, 0), (255, 255, 255), (255, 255, 255)]),
        (lambda: Image.fromarray(np.array([[0.0, 100.4, 300.0]], dtype=np.float32)), [(0, 0, 0), (100, 100, 100), (255, 255, 255)]),
    ],
)
def test_every_mode_becomes_rgb_as_a_viewer_shows_it(make, expected):
    image = make()
    loaded = load_image(image)
    assert loaded.image.mode == "RGB"
    assert [tuple(int(v) for v in pixel) for pixel in np.asarray(loaded.image).reshape(-1, 3)] == expected
    if image.mode in ("RGBA", "LA", "L", "1", "P", "I;16"):  # and the same through a PNG file
        assert load_image(encode(image, "PNG")).digest == loaded.digest


def test_sixteen_bit_png_is_scaled_not_clipped():
    decoded = Image.open(io.BytesIO(encode(sixteen_bit_grey(), "PNG")))
    assert decoded.mode == "I;16"
    loaded = load_image(encode(sixteen_bit_grey(), "PNG"))
    assert np.asarray(loaded.image)[0, :, 0].tolist() == [0, 128, 255]


def test_cmyk_jpeg_becomes_rgb():
    loaded = load_image(encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95))
    assert loaded.image.mode == "RGB"
    assert np.abs(pixels(loaded)[8, 8] - np.array([255, 0, 0])).max() <= 8


def test_animated_image_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    loaded = load_image(gif, limits=ImageLimits(formats=("GIF",)))
    assert tuple(np.asarray(loaded.image)[0, 0]) == (255, 0, 0)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (64, 32), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 32, 32))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: rotate 90° clockwise to show it
    loaded = load_image(encode(image, "JPEG", quality=95, exif=exif))
    assert loaded.size == (32, 64)
    top, bottom = pixels(loaded)[8, 16], pixels(loaded)[56, 16]
    assert top[0] > 200 and top[2] < 50  # the left half is now on top
    assert bottom[2] > 200 and bottom[0] < 50


# --- digest --------------------------------------------------------------------------------------------------------


def test_digest_is_of_the_pixels_not_the_file():
    image = gradient()
    as_pil = load_image(image)
    assert len(as_pil.digest) == 64 and int(as_pil.digest, 16) >= 0  # blake2b-256 in hex
    assert load_image(encode(image, "PNG")).digest == as_pil.digest
    assert load_image(encode(image, "PNG", compress_level=9)).digest == as_pil.digest
    assert load_image(encode(image, "WEBP", lossless=True)).digest == as_pil.digest

    changed = image.copy()
    changed.putpixel((47, 31), (0, 0, 1))
    assert load_image(changed).digest != as_pil.digest


def test_digest_ignores_exif_that_keeps_the_orientation():
    image = gradient()
    exif = Image.Exif()
    exif[0x010F] = "Some camera"  # Make
    exif[0x0112] = 1  # upright
    with_metadata = load_image(encode(image, "PNG", exif=exif))
    assert Image.open(io.BytesIO(encode(image, "PNG", exif=exif))).getexif()[0x010F] == "Some camera"
    assert with_metadata.digest == load_image(image).digest

    exif[0x0112] = 6
    assert load_image(encode(image, "PNG", exif=exif)).digest != load_image(image).digest  # rotated pixels


# --- bad images --------------------------------------------------------------------------------------------------


def test_truncated_png_is_refused():
    data = encode(noise(), "PNG")
    with pytest.raises(InvalidRequestError, match=rf"image 3 \({len(data) // 2} bytes\): .*truncated"):
        load_image(data[: len(data) // 2], index=3)


def test_random_bytes_are_refused():
    data = np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes()
    with pytest.raises(InvalidRequestError, match=r"image 2 \(500 bytes\): not an image file"):
        load_image(data, index=2)


@pytest.mark.parametrize("format", ["GIF", "BMP"])
def test_format_outside_the_accepted_ones_is_refused(format):
    with pytest.raises(InvalidRequestError, match=rf"image 1 .*format {format} is not accepted \(accepted: JPEG, PNG, WEBP\)"):
        load_image(encode(gradient(), format), index=1)


def test_more_pixels_than_allowed_is_refused():
    with pytest.raises(InvalidRequestError, match=r"image 4 .*20x20 is 400 pixels, more than the 100 allowed"):
        load_image(encode(Image.new("RGB", (20, 20)), "PNG"), index=4, limits=ImageLimits(max_pixels=100))
    with pytest.raises(InvalidRequestError, match=r"image 0 \(PIL image\): 20x20"):
        load_image(Image.new("RGB", (20, 20)), limits=ImageLimits(max_pixels=100))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width``×``height`` but which holds no pixel data at all."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [10_000, 50_000])  # past Pillow's warning; past its error
def test_decompression_bomb_is_refused_from_its_header(side):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(InvalidRequestError, match=r"image 5 \(\d+ bytes\)"):
            load_image(png_header_only(side, side), index=5)


def test_decompression_bomb_warning_raised_as_an_error_is_refused_too():
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(InvalidRequestError, match=r"image 0 .*at most 40000000 pixels"):
            load_image(png_header_only(10_000, 10_000))


def test_encoded_size_over_the_limit_is_refused(tmp_path):
    data = encode(noise(), "PNG")
    limits = ImageLimits(max_encoded_bytes=1000)
    with pytest.raises(InvalidRequestError, match=r"image 1 .*over the 1000 bytes allowed"):
        load_image(data, index=1, limits=limits)
    (tmp_path / "big.png").write_bytes(data)
    with pytest.raises(InvalidRequestError, match=r"image 2 .*over the 1000 bytes allowed"):
        load_image(tmp_path / "big.png", index=2, limits=limits)
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
    with pytest.raises(InvalidRequestError, match=r"image 3 \(data URL, image/png\): .*over the 1000 bytes allowed"):
        load_image(data_url, index=3, limits=limits)


def test_empty_image_is_refused():
    with pytest.raises(InvalidRequestError, match=r"image 6 \(PIL image\): the image is 0x5 pixels"):
        load_image(Image.new("RGB", (0, 5)), index=6)


@pytest.mark.parametrize("source, type_name", [(42, "int"), ([b"png"], "list"), (None, "NoneType")])
def test_unsupported_source_type_is_named(source, type_name):
    with pytest.raises(InvalidRequestError, match=rf"image 7: a {type_name} is not an image; send a PIL.Image.Image, bytes"):
        load_image(source, index=7)


def test_unsupported_url_scheme_is_refused():
    with pytest.raises(InvalidRequestError, match=r"image 0 \(ftp://host/a.png\): URL scheme ftp:// is not supported"):
        load_image("ftp://host/a.png")


def test_load_images_indexes_each_source():
    png = encode(gradient(), "PNG")
    loaded = load_images([png, memoryview(png), bytearray(png), gradient()])
    assert len({image.digest for image in loaded}) == 1
    with pytest.raises(InvalidRequestError, match=r"image 1 \(3 bytes\)"):
        load_images([png, b"bad"])
    with pytest.raises(InvalidRequestError, match="not one bytes; wrap it in a list"):
        load_images(png)


# --- local files -------------------------------------------------------------------------------------------------


@pytest.fixture
def image_folders(tmp_path):
    """``allowed/inside.png`` and ``outside.png`` beside the allowed folder."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    png = encode(gradient(), "PNG")
    (allowed / "inside.png").write_bytes(png)
    (tmp_path / "outside.png").write_bytes(png)
    return allowed


def test_local_paths_load_as_str_path_and_file_url(image_folders):
    inside = image_folders / "inside.png"
    expected = load_image(gradient()).digest
    assert load_image(inside).digest == expected
    assert load_image(str(inside)).digest == expected
    assert load_image(inside.as_uri()).digest == expected
    assert load_image(inside, local_files=image_folders).digest == expected


def test_local_files_can_be_refused(image_folders):
    inside = image_folders / "inside.png"
    for source in (inside, str(inside), inside.as_uri()):
        with pytest.raises(InvalidRequestError, match=r"image 2 .*local files are not accepted here"):
            load_image(source, index=2, local_files=False)


def test_paths_outside_the_allowed_folder_are_refused(image_folders):
    (image_folders / "link.png").symlink_to(image_folders.parent / "outside.png")
    (image_folders / "link-inside.png").symlink_to(image_folders / "inside.png")
    for source in (image_folders / ".." / "outside.png", image_folders / "link.png", (image_folders / "link.png").as_uri()):
        with pytest.raises(InvalidRequestError, match=r"image 1 .*only files inside .*allowed may be read"):
            load_image(source, index=1, local_files=image_folders)
    assert load_image(image_folders / "link-inside.png", local_files=image_folders).size == (48, 32)


def test_missing_or_unreadable_files_are_refused(image_folders):
    with pytest.raises(InvalidRequestError, match=r"image 0 .*missing.png\): no such file"):
        load_image(image_folders / "missing.png")
    with pytest.raises(InvalidRequestError, match=r"image 1 .*not a regular file"):
        load_image(image_folders, index=1)
    with pytest.raises(InvalidRequestError, match=r"image 2 .*not a usable path"):
        load_image("bad\0path.png", index=2)
    with pytest.raises(InvalidRequestError, match=r"image 3 .*must name a local file"):
        load_image("file://elsewhere/a.png", index=3)


def test_allowed_folder_that_does_not_exist_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        load_image(tmp_path / "a.png", local_files=tmp_path / "absent")


# --- data URLs ---------------------------------------------------------------------------------------------------


def test_data_url_loads():
    encoded = base64.b64encode(encode(gradient(), "PNG")).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    for url in (f"data:image/png;base64,{encoded}", f"DATA:image/png;base64,{wrapped}"):
        assert load_image(url).digest == load_image(gradient()).digest


@pytest.mark.parametrize(
    "url, problem",
    [
        ("data:image/png;base64,iVBORw0K!!!", r"\(data URL, image/png\): the data is not valid base64"),
        ("data:image/png;base64,iVBORw0", r"\(data URL, image/png\): the data is not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", r"\(data URL, text/plain\): not an image media type"),
        ("data:image/png,%89PNG", r"\(data URL, image/png\): only base64 data URLs are accepted"),
        ("data:image/png;base64", r"\(data URL, image/png\): no ',' before the data"),
        ("data:image/png;base64,aGVsbG8=", r"\(data URL, image/png\): not an image file"),
    ],
)
def test_bad_data_urls_are_refused(url, problem):
    with pytest.raises(InvalidRequestError, match=rf"image 8 {problem}"):
        load_image(url, index=8)


# --- http(s) URLs, from a loopback server ------------------------------------------------------------------------

PNG = encode(gradient(), "PNG")


class ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/image.png":
            self.answer(200, PNG)
        elif self.path == "/big.png":  # declares its length
            self.answer(200, PNG + bytes(5000))
        elif self.path == "/big-undeclared.png":  # no Content-Length: read until the limit
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PNG + bytes(5000))
        elif self.path == "/cut.png":  # promises more than it sends
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG[:100])
            self.close_connection = True
        elif self.path == "/garbage.png":  # not HTTP at all
            self.wfile.write(b"garbage\r\n\r\n")
            self.close_connection = True
        elif self.path == "/slow.png":  # silent longer than the client's timeout
            time.sleep(3)
            self.answer(200, PNG)
        elif self.path == "/drip.png":  # never silent for long, never done in time
            self.send_response(200)
            self.end_headers()
            try:
                for byte in PNG[:60]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass  # the client gave up
        else:
            self.answer(404, b"not here")

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(30)
def test_http_url_loads(server_url):
    assert load_image(f"{server_url}/image.png").digest == load_image(gradient()).digest


@pytest.mark.timeout(30)
def test_http_error_status_is_refused(server_url):
    url = f"{server_url}/missing?" + "x" * 200
    with pytest.raises(InvalidRequestError, match=r"image 1 \(http://127.0.0.1:\d+/missing\?x+…\): the server answered HTTP 404") as raised:
        load_image(url, index=1)
    assert url not in str(raised.value)  # shortened


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/big.png", "/big-undeclared.png"])
def test_http_answer_over_the_limit_is_refused(server_url, path):
    with pytest.raises(InvalidRequestError, match=r"image 2 .*over the 1000 bytes allowed"):
        load_image(server_url + path, index=2, limits=ImageLimits(max_encoded_bytes=1000))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/slow.png", "/drip.png"])
def test_http_timeout_is_refused(server_url, path):
    with pytest.raises(InvalidRequestError, match=r"image 3 .*no complete answer within 0.5 s"):
        load_image(server_url + path, index=3, limits=ImageLimits(fetch_timeout_s=0.5))


@pytest.mark.timeout(30)
def test_http_answer_cut_short_is_refused(server_url):
    with pytest.raises(InvalidRequestError, match=rf"image 5 .*the connection closed after 100 of {len(PNG)} bytes"):
        load_image(f"{server_url}/cut.png", index=5)
    with pytest.raises(InvalidRequestError, match=r"image 6 .*the download failed \(.*garbage"):
        load_image(f"{server_url}/garbage.png", index=6)


@pytest.mark.timeout(30)
def test_http_connection_refused_is_reported():
    with socket.socket() as probe:  # a port that was free a moment ago, with nothing listening on it now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(InvalidRequestError, match=r"image 4 .*cannot connect"):
        load_image(f"http://127.0.0.1:{port}/image.png", index=4)
