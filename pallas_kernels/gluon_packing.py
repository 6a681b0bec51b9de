"""How the Gluon codec kernels pack sub-byte codes into 32-bit words and decode them:
the words' layout in a thread (a unit of codes that fills whole words), the stores and
loads of packed rows, integer codes decoded in place in a float32's mantissa, sub-byte
floats through float16, and the 6-bit floats converted through an FP8 carrier with as
many mantissa bits. `gluon_codec` quantizes and sums on top of it; the words hold the
codes as `formats.pack_codes` packs them.
"""

from __future__ import annotations

import math

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # no Triton with Gluon: nothing below is traced
    gluon = gl = None


def codes_per_unit(bits: int) -> int:
    """U: the codes of the shortest run that fills whole 32-bit words (the kernels pack
    and unpack a unit in one thread); 4 for 8-bit codes."""
    return 32 // math.gcd(bits, 32)


if gluon is not None:

    @gluon.constexpr_function
    def fp8_carrier(EXPONENT_BITS, MANTISSA_BITS):
        """(the PTX name of a pair of the FP8 type, its exponent bias) whose conversion
        rounds a sub-byte float's values exactly as the format does, once they are
        scaled by `carrier_scale`: the type with as many mantissa bits (Hopper converts
        float32 pairs to FP8 in one instruction). None for E2M1 and the integers."""
        return {(2, 3): ("e4m3x2", 7), (3, 2): ("e5m2x2", 15)}.get((EXPONENT_BITS, MANTISSA_BITS))

    @gluon.constexpr_function
    def carrier_scale(EXPONENT_BITS, MANTISSA_BITS):
        """The power of two that maps a sub-byte float's smallest normal onto its FP8
        carrier's (2**-6: E2M3's 1 to E4M3's 2**-6; 2**-12: E3M2's 2**-2 to E5M2's
        2**-14): the two grids then coincide over the format's range, and the carrier's
        exponent field is the format's. 1.0 for formats without a carrier."""
        if fp8_carrier(EXPONENT_BITS, MANTISSA_BITS) is None:
            return 1.0
        return float(2.0 ** ((2 ** (EXPONENT_BITS - 1) - 1) - fp8_carrier(EXPONENT_BITS, MANTISSA_BITS)[1]))

    @gluon.constexpr_function
    def carrier_field(EXPONENT_BITS, MANTISSA_BITS):
        """Codes a kernel converts and packs at once: the four of a 24-bit field for a
        float with an FP8 carrier (`carrier_packing`), else one."""
        return 1 if fp8_carrier(EXPONENT_BITS, MANTISSA_BITS) is None else 4

    @gluon.constexpr_function
    def bit_moves(shift, steps):
        """PTX moving bit fields of the register w: for each (n, moved, kept), the bits
        `moved` of w shifted by n (`shift`: "shl" or "shr") joined to the bits `kept`."""
        return "\n".join(
            f"{shift}.b32 t, w, {n}; and.b32 t, t, {moved:#010x}; and.b32 w, w, {kept:#010x}; or.b32 w, w, t;"
            for n, moved, kept in steps
        )

    @gluon.constexpr_function
    def carrier_packing(EXPONENT_BITS, MANTISSA_BITS):
        """PTX of four values ($4..$7, times `carrier_scale`) to their 6-bit codes packed
        into a 24-bit field ($0, the first code lowest; $1..$3 zero): two conversions to
        the FP8 carrier (a byte each, its exponent field's top bits zero), each byte's
        sign moved down next to its 5 fields, then the 6-bit codes closed up, byte pairs
        into 12 bits, then the two halves into 24. Nine logic operations for four codes,
        where packing them one by one takes about twenty."""
        pair = fp8_carrier(EXPONENT_BITS, MANTISSA_BITS)[0]
        return f"""{{
        .reg .b16 low, high;
        .reg .b32 w, t;
        cvt.rn.satfinite.{pair}.f32 low, $5, $4;
        cvt.rn.satfinite.{pair}.f32 high, $7, $6;
        mov.b32 w, {{low, high}};
        {bit_moves("shr", ((2, 0x20202020, 0x1F1F1F1F), (2, 0x0FC00FC0, 0x003F003F), (4, 0x00FFF000, 0x00000FFF)))}
        mov.b32 $0, w;
        mov.b32 $1, 0;
        mov.b32 $2, 0;
        mov.b32 $3, 0;
        }}"""

    @gluon.constexpr_function
    def half_exponent_scale(EXPONENT_BITS):
        """2**(15 - bias): a sub-byte float's sign, exponent and mantissa bits placed in a
        float16's (its exponent field at the bottom of float16's) read as float16 times
        this are its value, subnormals included (float16's own subnormals)."""
        return float(2.0 ** (15 - (2 ** (EXPONENT_BITS - 1) - 1)))

    @gluon.jit
    def minifloat_values(codes, EXPONENT_BITS: gl.constexpr, MANTISSA_BITS: gl.constexpr):
        """float32 values of int32 sub-byte float codes (`formats.WireFormat.from_codes`)
        over `code_unit`, through a float16 (`half_exponent_scale`): a few instructions
        where decoding the fields takes a dozen."""
        FIELDS: gl.constexpr = EXPONENT_BITS + MANTISSA_BITS
        half = (((codes >> FIELDS) & 1) << 15) | ((codes & ((1 << FIELDS) - 1)) << (10 - MANTISSA_BITS))
        return half.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.constexpr_function
    def code_unit(INTEGER, EXPONENT_BITS, MANTISSA_BITS):
        """The power of two the decoded codes (`packed_values`, `carrier_values`) are in
        units of, which a multiplier takes on: 1 for integers, `half_exponent_scale` for
        floats decoded through float16, 1 / `carrier_scale` through an FP8 carrier."""
        if INTEGER:
            return 1.0
        if fp8_carrier(EXPONENT_BITS, MANTISSA_BITS) is not None:
            return 1.0 / carrier_scale(EXPONENT_BITS, MANTISSA_BITS)
        return half_exponent_scale(EXPONENT_BITS)

    @gluon.constexpr_function
    def carrier_unpacking(EXPONENT_BITS, MANTISSA_BITS):
        """PTX of a 24-bit field of four 6-bit codes ($4, `carrier_packing`'s) to their
        values as float32 times `carrier_scale` ($0..$3, the first code first): the
        packing's steps undone (halves, bytes, the sign back to bit 7), then two pair
        conversions from the FP8 carrier to float16, exact, and on to float32."""
        pair = fp8_carrier(EXPONENT_BITS, MANTISSA_BITS)[0]
        return f"""{{
        .reg .b16 low, high, h0, h1, h2, h3;
        .reg .b32 w, t, p, q;
        mov.b32 w, $4;
        {bit_moves("shl", ((4, 0x0FFF0000, 0x00000FFF), (2, 0x3F003F00, 0x003F003F), (2, 0x80808080, 0x1F1F1F1F)))}
        mov.b32 {{low, high}}, w;
        cvt.rn.f16x2.{pair} p, low;
        cvt.rn.f16x2.{pair} q, high;
        mov.b32 {{h0, h1}}, p;
        mov.b32 {{h2, h3}}, q;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        }}"""

    @gluon.jit
    def carrier_values(fields, EXPONENT_BITS: gl.constexpr, MANTISSA_BITS: gl.constexpr):
        """The four codes of each 24-bit field as float32 times `carrier_scale`: four
        tensors in the fields' layout, the first codes first (`carrier_unpacking`)."""
        return gl.inline_asm_elementwise(
            carrier_unpacking(EXPONENT_BITS, MANTISSA_BITS),
            "=r,=r,=r,=r,r",
            [fields],
            [gl.float32, gl.float32, gl.float32, gl.float32],
            True,
            1,
        )

    @gluon.jit
    def interleave_four(first, second, third, fourth):
        """(a, b, 4 n) of four (a, b, n) tensors: element i of each at 4 i, 4 i + 1, ..."""
        joined = gl.join(gl.join(first, third), gl.join(second, fourth))
        return joined.reshape([first.shape[0], first.shape[1], first.shape[2] * 4])

    @gluon.constexpr_function
    def unit_codes(BITS):
        """`codes_per_unit` at compile time (a constexpr function calls no plain Python
        function)."""
        return 32 // math.gcd(BITS, 32)

    @gluon.constexpr_function
    def unit_words(BITS):
        """The 32-bit words U codes fill."""
        return BITS // math.gcd(BITS, 32)

    @gluon.constexpr_function
    def padded_words(BITS):
        """`unit_words` rounded up to a power of two (a tensor's extent)."""
        return 1 << (unit_words(BITS) - 1).bit_length()

    @gluon.constexpr_function
    def packing_layout(G, BITS, NUM_WARPS, VALUES):
        """(rows, units, padded words, codes) of packed groups: whole units in one thread,
        VALUES consecutive codes of a group if that is a whole number of them (as the
        split layout of V = VALUES holds them, so that no values move between the two),
        at least one, and at most 32 lanes a group."""
        U = unit_codes(BITS)
        values = max(VALUES, U, G // 32)
        return gl.BlockedLayout(
            [1, values // U, padded_words(BITS), U],
            [32 // (G // values), G // values, 1, 1],
            [NUM_WARPS, 1, 1, 1],
            [3, 2, 1, 0],
        )

    @gluon.constexpr_function
    def row_elements(G, BITS):
        """Elements of the payload pointer's type a group takes: G codes, or its packed
        codes' G * BITS / 32 words."""
        return G if BITS == 8 else G * BITS // 32

    @gluon.jit
    def _shift_down(words, offset):
        """uint32 words >> offset, a negative offset shifting them up instead."""
        return gl.where(
            offset >= 0, words >> gl.maximum(offset, 0).to(gl.uint32), words << gl.maximum(-offset, 0).to(gl.uint32)
        )

    @gluon.jit
    def _field_offsets(G: gl.constexpr, BITS: gl.constexpr, NUM_WARPS: gl.constexpr, VALUES: gl.constexpr):
        """(1, 1, WP, U): where code i of a unit starts in its word k, BITS * i - 32 * k
        (negative: it started in the word before). Past the unit's words every code
        lies wholly before the word."""
        layout: gl.constexpr = packing_layout(G, BITS, NUM_WARPS, VALUES)
        # Each expanded axis by axis, left to right, as its layout is sliced.
        words = gl.arange(0, padded_words(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        codes = gl.arange(0, unit_codes(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        return BITS * codes[None, None, None, :] - 32 * words[None, None, :, None]

    @gluon.jit
    def packed_offsets(
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """(word offsets, mask) of rows [start, start + ROWS) of packed groups (G * BITS
        / 32 words a row), as (rows, units, padded words) in `packing_layout`; the mask
        drops rows past n_rows and the padding words."""
        layout: gl.constexpr = gl.SliceLayout(3, packing_layout(G, BITS, NUM_WARPS, VALUES))
        U: gl.constexpr = unit_codes(BITS)
        rows = start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        units = gl.arange(0, G // U, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        words = gl.arange(0, padded_words(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        offsets = (
            rows.to(gl.int64)[:, None, None] * row_elements(G, BITS)
            + (units * unit_words(BITS))[None, :, None]
            + words[None, None, :]
        )
        return offsets, (rows < n_rows)[:, None, None] & (words < unit_words(BITS))[None, None, :]

    @gluon.constexpr_function
    def group_store_values(G, BITS, FIELDS):
        """`store_packed`'s VALUES for codes held a group a thread, in FIELDS fields a
        group: the whole group where a unit fills a power of two of words, stored as
        vectors; else one unit a thread, so that a warp's scalar stores of its units'
        words are contiguous across its lanes (from a G = 128 group of E2M3 a thread they
        lay 96 bytes apart, and the row compress ran at 36% of a copy against 92%:
        `kernels_packed_ab_in_place.json`)."""
        field_bits = G * BITS // FIELDS
        return G if unit_words(field_bits) == padded_words(field_bits) else 1

    @gluon.jit
    def store_packed(
        base,
        codes,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """Store int32 codes (ROWS, G) (their low BITS bits) packed as `formats.pack_codes`
        packs them (32-bit words, little-endian) into rows [start, ...) at `base` (a
        uint32 pointer); rows past n_rows are not stored. `codes` may also be (ROWS, G /
        F) fields of F consecutive codes each (`sub_byte_codes`), packed alike."""
        # Fields: FIELDS of FIELD_BITS bits a row, packed as codes are.
        FIELDS: gl.constexpr = codes.shape[1]
        FIELD_BITS: gl.constexpr = G * BITS // FIELDS
        VALUE_FIELDS: gl.constexpr = VALUES * FIELDS // G
        U: gl.constexpr = unit_codes(FIELD_BITS)
        layout: gl.constexpr = packing_layout(FIELDS, FIELD_BITS, NUM_WARPS, VALUE_FIELDS)
        units = gl.convert_layout(codes.reshape([ROWS, FIELDS // U, U]), gl.SliceLayout(2, layout))
        offset = _field_offsets(FIELDS, FIELD_BITS, NUM_WARPS, VALUE_FIELDS)
        fields = units.to(gl.uint32, bitcast=True)[:, :, None, :]
        placed = _shift_down(fields, -offset)
        # The fields of a word are disjoint: their sum is their bitwise or.
        words = gl.sum(gl.where((offset > -FIELD_BITS) & (offset < 32), placed, 0), axis=3)
        offsets, mask = packed_offsets(start, n_rows, ROWS, FIELDS, FIELD_BITS, NUM_WARPS, VALUE_FIELDS)
        gl.store(base + offsets, words, mask=mask)

    @gluon.jit
    def load_packed(
        base,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """int32 codes (ROWS, G / U, U) of rows [start, ...) of packed groups at `base` (a
        uint32 pointer), in `packing_layout` sliced at its words: `store_packed`'s
        inverse; rows past n_rows are not read (their codes are undefined)."""
        offsets, mask = packed_offsets(start, n_rows, ROWS, G, BITS, NUM_WARPS, VALUES)
        words = gl.load(base + offsets, mask=mask)[:, :, :, None]
        offset = _field_offsets(G, BITS, NUM_WARPS, VALUES)
        fields = gl.where((offset > -BITS) & (offset < 32), _shift_down(words, offset) & ((1 << BITS) - 1), 0)
        return gl.sum(fields, axis=2).to(gl.int32, bitcast=True)

    @gluon.constexpr_function
    def window_codes(BITS):
        """Consecutive codes one 32-bit window of packed codes holds where a float32's
        mantissa can take each in place: the last starting at most 23 - BITS bits in."""
        return (23 - BITS) // BITS + 1

    @gluon.jit
    def integer_values(
        base,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        BITS: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
    ):
        """float32 values of the two's-complement codes `load_packed` loads, in its layout.
        The codes are read in windows of `window_codes` (a word, or two words' funnel
        shift); code i of a window, at bit p, is masked in place, its sign bit flipped and
        a float32 exponent set above it: for a code of value v, the float 2**(23 - p) + v +
        2**(BITS - 1), which less the same float at v = 0 is v, exact. One logic operation
        and one addition a code, where shifting each down and converting it takes three."""
        offsets, mask = packed_offsets(start, n_rows, ROWS, G, BITS, NUM_WARPS, VALUES)
        words = gl.load(base + offsets, mask=mask)[:, :, :, None]
        layout: gl.constexpr = packing_layout(G, BITS, NUM_WARPS, VALUES)
        C: gl.constexpr = window_codes(BITS)
        word = gl.arange(0, padded_words(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        code = gl.arange(0, unit_codes(BITS), layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        # Where each code's window starts, relative to each word of its unit.
        offset = ((code // C) * (C * BITS))[None, None, None, :] - 32 * word[None, None, :, None]
        in_window = (offset > -C * BITS) & (offset < 32) & (word < unit_words(BITS))[None, None, :, None]
        windows = gl.sum(gl.where(in_window, _shift_down(words, offset), 0), axis=2).to(gl.int32, bitcast=True)
        position = ((code % C) * BITS)[None, None, :]
        magic = ((150 - position) << 23) | ((1 << (BITS - 1)) << position)
        # (windows & field) ^ magic in one instruction: written apart, each constant takes
        # its own (an instruction holds one immediate).
        biased = gl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0x6A;",
            "=r,r,r,r",
            [windows, ((1 << BITS) - 1) << position, magic],
            dtype=gl.int32,
            is_pure=True,
            pack=1,
        )
        return biased.to(gl.float32, bitcast=True) - magic.to(gl.float32, bitcast=True)

    @gluon.constexpr_function
    def int4_pair_sums():
        """PTX adding the eight INT4 codes of a word ($4; code i at bits 4 i, two's
        complement) times a float16 pair ($5: r, r) to four float16x2 sums ($6..$9 in,
        $0..$3 out) of codes (0, 4), (1, 5), (2, 6) and (3, 7). A field masked in place,
        its sign bit flipped and float16's exponent of 1024 set above it reads as 1032 +
        c (a field at bit 0 of its half) or 1152 + 16 c (at bit 4), from which one fused
        multiply-add takes c exactly; a second adds c r. Two codes an instruction: about
        1.6 instructions a code, where a float32 decode and sum take three."""
        return """{
        .reg .b32 t, h, c, one, low, sixteenth, high;
        mov.b32 one, 0x3C003C00;
        mov.b32 low, 0xE408E408;
        mov.b32 sixteenth, 0x2C002C00;
        mov.b32 high, 0xD480D480;
        lop3.b32 h, $4, 0x000F000F, 0x64086408, 0x6A;
        fma.rn.f16x2 c, h, one, low;
        fma.rn.f16x2 $0, c, $5, $6;
        lop3.b32 h, $4, 0x00F000F0, 0x64806480, 0x6A;
        fma.rn.f16x2 c, h, sixteenth, high;
        fma.rn.f16x2 $1, c, $5, $7;
        shr.b32 t, $4, 8;
        lop3.b32 h, t, 0x000F000F, 0x64086408, 0x6A;
        fma.rn.f16x2 c, h, one, low;
        fma.rn.f16x2 $2, c, $5, $8;
        lop3.b32 h, t, 0x00F000F0, 0x64806480, 0x6A;
        fma.rn.f16x2 c, h, sixteenth, high;
        fma.rn.f16x2 $3, c, $5, $9;
        }"""

    @gluon.jit
    def half_pairs(values):
        """int32 words holding (v, v) as float16, rounded to nearest (NaN kept)."""
        return gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $1, $1;", "=r,r", [values], dtype=gl.int32, is_pure=True, pack=1
        )

    @gluon.jit
    def accumulate_int4_pairs(sums, words, ratio_pairs):
        """`int4_pair_sums` over tensors: the four float16x2 sums (a tuple of int32
        tensors shaped as `words`) plus each word's codes times its row's pair."""
        return gl.inline_asm_elementwise(
            int4_pair_sums(),
            "=r,=r,=r,=r,r,r,r,r,r,r",
            [words, ratio_pairs, sums[0], sums[1], sums[2], sums[3]],
            [gl.int32, gl.int32, gl.int32, gl.int32],
            True,
            1,
        )

    @gluon.jit
    def half_pair_values(pairs):
        """(low, high) float32 of float16x2 words."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 low, high; mov.b32 {low, high}, $2; cvt.f32.f16 $0, low; cvt.f32.f16 $1, high; }",
            "=r,=r,r",
            [pairs],
            [gl.float32, gl.float32],
            True,
            1,
        )

    @gluon.jit
    def int4_pair_values(sums):
        """float32 (rows, words * 8) of `accumulate_int4_pairs`' sums over (rows, words,
        1) words, each word's eight values in code order."""
        c0, c4 = half_pair_values(sums[0])
        c1, c5 = half_pair_values(sums[1])
        c2, c6 = half_pair_values(sums[2])
        c3, c7 = half_pair_values(sums[3])
        # The last join picks the lowest bit of a code's index (`interleave_four`).
        even = gl.join(gl.join(c0, c4), gl.join(c2, c6))
        odd = gl.join(gl.join(c1, c5), gl.join(c3, c7))
        return gl.join(even, odd).reshape([c0.shape[0], c0.shape[1] * 8])

    @gluon.jit
    def packed_values(
        base,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """float32 values over `code_unit` of packed codes of a format without an FP8
        carrier, as `load_packed` loads them (`integer_values`, `minifloat_values`)."""
        if INTEGER:
            values = integer_values(base, start, n_rows, ROWS, G, BITS, NUM_WARPS, VALUES)
        else:
            codes = load_packed(base, start, n_rows, ROWS, G, BITS, NUM_WARPS, VALUES)
            values = minifloat_values(codes, EXPONENT_BITS, MANTISSA_BITS)
        return values

    @gluon.jit
    def group_values(
        base,
        start,
        n_rows,
        ROWS: gl.constexpr,
        G: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        VALUES: gl.constexpr,
        INTEGER: gl.constexpr,
        BITS: gl.constexpr,
        EXPONENT_BITS: gl.constexpr,
        MANTISSA_BITS: gl.constexpr,
    ):
        """float32 values (ROWS, G) of rows [start, ...) of packed codes at `base`, in the
        groups' order and the layout they unpack in (`packed_values`, or a carrier's four
        codes of a field interleaved): the codes' values, their `code_unit` applied."""
        F: gl.constexpr = carrier_field(EXPONENT_BITS, MANTISSA_BITS)
        if F == 1:
            values = packed_values(
                base, start, n_rows, ROWS, G, NUM_WARPS, VALUES, INTEGER, BITS, EXPONENT_BITS, MANTISSA_BITS
            )
        else:
            values = carrier_values(
                load_packed(base, start, n_rows, ROWS, G // F, BITS * F, NUM_WARPS, VALUES // F),
                EXPONENT_BITS,
                MANTISSA_BITS,
            )
            values = interleave_four(values[0], values[1], values[2], values[3])
        return values.reshape([ROWS, G]) * code_unit(INTEGER, EXPONENT_BITS, MANTISSA_BITS)
