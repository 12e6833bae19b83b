"""Prints the size and colour statistics of a PNG screenshot, using only the standard library.

Usage: png_stats.py FILE MIN_COLOURS MIN_NON_WHITE_FRACTION
Exits 1 when the image has fewer distinct colours or non-white pixels than required
(a blank or failed render), 0 otherwise.
"""
import struct
import sys
import zlib


def read_png(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour_type = header[:4]
    if depth != 8 or colour_type not in (2, 6):
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour_type}")
    bpp = 3 if colour_type == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def main():
    path, min_colours, min_fraction = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    width, height, bpp, rows = read_png(path)
    colours, non_white, total = set(), 0, 0
    for row in rows[::2]:
        for x in range(0, width * bpp, bpp * 2):
            pixel = row[x:x + 3]
            colours.add(pixel)
            total += 1
            if pixel != b"\xff\xff\xff":
                non_white += 1
    fraction = non_white / max(total, 1)
    print(f"{path}: {width}x{height}, {len(colours)} colours, {fraction:.3f} non-white")
    return 0 if len(colours) >= min_colours and fraction >= min_fraction else 1


if __name__ == "__main__":
    sys.exit(main())
