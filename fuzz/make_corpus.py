#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/).

fuzz_validate_segment: control segment images laid out as
shm/include/shmps/shm/layout.hpp says (its kLayoutVersion): valid ones of a
few geometries and states, and a few near misses. Run it again after a
layout change.
fuzz_requests: record sequences in the format fuzz_requests.cpp documents
(attach is done by the harness; these exercise each opcode and each poke).
fuzz_checkpoint: checkpoint files as server/src/checkpoint.hpp lays them
out, of the harness's model (Adam on a:2x2, b:3) and of others.
fuzz_federation: a config and the five streams fuzz_federation.cpp
documents (zeros are the honest choice: most streams are short or empty).

Deterministic; the output is committed (keep it small). Run from anywhere:
  fuzz/make_corpus.py
"""
import os
import struct
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC = 0x31474553504D4853


# The harness's switch (fuzz_validate_segment.cpp, kSwitchAt): the first
# byte of SegmentHeader::reserved5. Non-zero: the image keeps its own layout
# version instead of having the current one written into it.
SWITCH_AT = 576


def layout_version():
    """kLayoutVersion as shm/include/shmps/shm/layout.hpp defines it."""
    with open(os.path.join(HERE, "..", "shm", "include", "shmps", "shm", "layout.hpp")) as f:
        for line in f:
            if "kLayoutVersion =" in line:
                return int(line.split("=")[1].split(";")[0])
    raise SystemExit("kLayoutVersion not found in layout.hpp")


LAYOUT_VERSION = layout_version()
HEADER, TENSOR, ENTRY, BUFDESC, LANEHDR, REQUEST, COMPLETION, STATS = 4096, 128, 512, 192, 256, 64, 128, 2176


def align(v, a):
    return (v + a - 1) // a * a


def geometry(tensors, workers, buffers, cap):
    g = {"tensor_table": HEADER}
    g["worker_table"] = align(HEADER + tensors * TENSOR, 64)
    g["entry_size"] = ENTRY + buffers * BUFDESC
    g["lanes"] = align(g["worker_table"] + workers * g["entry_size"], 64)
    g["lane_stride"] = align(LANEHDR + cap * (REQUEST + 8), 64)  # requests, then publish_ns stamps
    g["completions"] = g["lanes"] + workers * g["lane_stride"]
    g["completion_stride"] = LANEHDR + cap * COMPLETION
    g["stats"] = g["completions"] + workers * g["completion_stride"]
    g["size"] = align(g["stats"] + STATS, 4096)
    return g


def put(img, off, fmt, *vals):
    struct.pack_into("<" + fmt, img, off, *vals)


def request(request_id=0, opcode=0, worker_id=0, lease=0, buffer_id=0, tensor_id=0, byte_offset=0,
            byte_length=0, worker_version=0, dtype=0, flags=0):
    return struct.pack("<QIIQIIQQQII", request_id, opcode, worker_id, lease, buffer_id, tensor_id, byte_offset,
                       byte_length, worker_version, dtype, flags)


def segment(shapes, workers=1, buffers=1, cap=2, optimizer=1, backend=1, populate=False):
    g = geometry(len(shapes), workers, buffers, cap)
    img = bytearray(g["size"])
    total = 0
    for i, (name, shape) in enumerate(shapes):
        off = g["tensor_table"] + i * TENSOR
        img[off:off + len(name)] = name.encode()
        count = 1
        for d in shape:
            count *= d
        dims = list(shape) + [0] * (4 - len(shape))
        put(img, off + 64, "II4QQQ", 1, len(shape), *dims, total, count)
        total += count
    put(img, 0, "QIIQQIIQII", MAGIC, LAYOUT_VERSION, HEADER, g["size"], 0x1234, 1, 0, 0,
        2, 0)  # magic, version, header_size, size, generation, server pid 1, start 0, state kRunning
    put(img, 64, "QIIQIIIIQQQQQQ", g["tensor_table"], len(shapes), TENSOR, g["worker_table"], workers,
        g["entry_size"], buffers, cap, g["lanes"], g["lane_stride"], g["completions"], g["completion_stride"],
        g["stats"], total)
    put(img, 192, "II7fIQ", optimizer, 0, 0.01, 0.9, 0.0, 0.0, 0.9, 0.999, 1e-8, backend, 4)
    if populate:
        # worker 0 attached (pid 1), one shm buffer and one CUDA IPC buffer,
        # two requests queued, one completion waiting.
        e = g["worker_table"]
        put(img, e, "QQQ", (1 << 32) | 2, 12345, 0xABCD)
        d = e + ENTRY
        put(img, d, "IIQQ", 1, 0, 64, 0)
        name = b"shmps.job.p1.0"
        img[d + 24:d + 24 + len(name)] = name
        if buffers > 1:
            put(img, d + BUFDESC, "IIQQ", 2, 0, 4096, 0)
            img[d + BUFDESC + 152:d + BUFDESC + 168] = bytes(range(16))
        lane = g["lanes"]
        put(img, lane, "Q", 2)  # tail
        put(img, lane + 64, "Q", 0)  # head
        img[lane + LANEHDR:lane + LANEHDR + REQUEST] = request(1, 5, 0, 0xABCD, 0, 0, 0, 16, 0, 1)
        img[lane + LANEHDR + REQUEST:lane + LANEHDR + 2 * REQUEST] = request(2, 6, 0, 0xABCD, 0, 0xFFFFFFFF)
        cq = g["completions"]
        put(img, cq, "Q", 1)
        c = cq + LANEHDR
        put(img, c, "QIIQQ", 1, 7, 9, 3, 0)
        img[c + 64:c + 64 + 12] = b"stale or bad"
        if workers > 1:
            # worker 1: claimed by a dead pid, its lane indices garbage.
            put(img, e + g["entry_size"], "QQ", (0x3FFFFFFE << 32) | 1, 7)
            put(img, lane + g["lane_stride"], "Q", 1 << 40)
        put(img, g["stats"], "QQQ", 10, 10, 3)
        put(img, g["stats"] + 128 + 8 * 9, "Q", 2)  # rejected[kBadRequest]
    return bytes(img)


def fixed(opcode, tensor_sel=0, buffer_id=0, dtype_raw=0, version_back=0, bits=0xF8, kind=2, byte_offset=0,
          byte_length=0, lease=0):
    """A fixed-up request record: opcode is the Opcode value wanted."""
    return bytes([kind | bits]) + request(0, opcode - 1, 0, lease, buffer_id, tensor_sel, byte_offset,
                                         byte_length, version_back, dtype_raw, 0)


def desc(slot, obj, length=0, offset=0, bits=0xE0):
    body = struct.pack("<IIQQ", 1, 0, length, offset) + bytes(64 + 64 + 16) + struct.pack("<QQQ", obj, 0, 0)
    return bytes([0x00 | bits, slot]) + body


def poke(field, value):
    return bytes([4, field]) + struct.pack("<Q", value & (2**64 - 1))


def index(which, value):
    return bytes([5, which]) + struct.pack("<Q", value & (2**64 - 1))


def doorbell(word, bits):
    return bytes([6, word]) + struct.pack("<Q", bits)


POLL = bytes([7])
PUSH, PULL, REG, UNREG, STATS_, PING, DETACH, ATTACH = 5, 6, 3, 4, 7, 8, 2, 1


def requests_corpus():
    return {
        "ping": fixed(PING) + POLL,
        "push_w": fixed(PUSH, tensor_sel=0, buffer_id=0) + POLL + fixed(PULL, tensor_sel=0, buffer_id=1) + POLL,
        "push_all_pull_all": fixed(PUSH, tensor_sel=2, buffer_id=0) + fixed(PULL, tensor_sel=2, buffer_id=1) + POLL,
        "push_nan": fixed(PUSH, tensor_sel=2, buffer_id=1) + POLL,
        "push_f16_bf16": fixed(PUSH, tensor_sel=1, dtype_raw=1) + fixed(PUSH, tensor_sel=1, dtype_raw=2) + POLL,
        "push_stale": fixed(PUSH) + fixed(PUSH) + fixed(PUSH) + fixed(PUSH) + fixed(PUSH) +
                      fixed(PUSH, version_back=7, bits=0xF0) + POLL,
        "register_spare": desc(2, 2) + fixed(REG, buffer_id=2) + fixed(PUSH, tensor_sel=1, buffer_id=2) +
                          fixed(UNREG, buffer_id=2) + POLL,
        "register_bad": desc(3, 1, length=9999, offset=100, bits=0xA0) + fixed(REG, buffer_id=3) +
                        fixed(REG, buffer_id=0) + fixed(REG, buffer_id=4) + POLL,
        "stats_detach": fixed(STATS_) + fixed(DETACH) + fixed(PING) + POLL,
        "attach_again": fixed(ATTACH) + poke(0, 1) + fixed(ATTACH) + fixed(PING) + POLL,
        "owner_pokes": poke(0, 2) + fixed(PING) + poke(0, 3) + fixed(PING) + poke(0, 0) + fixed(PING) + POLL +
                       poke(1, 0x3FFFFFFE00000002) + POLL + poke(0, 2) + fixed(PUSH) + POLL,
        "lease_poke": poke(2, 77) + fixed(PING) + fixed(PING, bits=0x78) + POLL,
        "index_pokes": fixed(PING) + index(0, 3) + POLL + index(2, 1) + fixed(PING) + index(7, 1 << 63) + POLL,
        "doorbells": doorbell(0, 0xFFFFFFFFFFFFFFFF) + doorbell(3, 1 << 63) + fixed(PING) + POLL,
        "raw": bytes([1]) + request(9, 5, 0, 0, 0, 0, 0, 4, 0, 1) + bytes([1]) + bytes(64) + POLL,
        "full_lane": b"".join(fixed(PING) for _ in range(12)) + POLL,
        # Released by the server (owner pid not alive), then claimed to be
        # attached without an attach: requests naming buffers must be refused.
        "forged_attached_after_release": poke(1, (0x3FFFFFFE << 32) | 1) + POLL + poke(0, 2) +
                                         fixed(REG, buffer_id=1, bits=0x78) + fixed(PUSH, bits=0x78) + POLL,
    }


CKPT_MAGIC = 0x314B4353504D4853  # "SHMPSCK1"


def checkpoint(tensors, optimizer=2, state_arrays=2, version=5, steps=None, fill=0.25, crc_ok=True, federation=None,
               fed_format=5, restore_base=False):
    """One checkpoint file (checkpoint.cpp's CheckpointHeader and CheckpointTensor); with `federation`, a list
    of RoundGroups spans (group, first, last, members), a federation section at round 4 (format 5, with a
    restore base holding 1 of its 2 unmerged updates when `restore_base`; format 4 has a 32-byte record,
    format 3 stores the spans without their members, format 2 has no spans)."""
    total = 0
    records = b""
    for i, (name, shape) in enumerate(tensors):
        n = 1
        for d in shape:
            n *= d
        total += n
        step = version if steps is None else steps[i]
        records += name.encode().ljust(64, b"\0") + struct.pack("<II4QQ", len(shape), 0,
                                                                *(list(shape) + [0] * (4 - len(shape))), step)
    fed = federation is not None
    flags = (1 | (4 if restore_base else 0)) if fed else 0  # kCheckpointFederation, kCheckpointRestoreBase
    header = struct.pack("<QIIQIIIIQ2Q", CKPT_MAGIC, fed_format if fed else 1, 64, version, optimizer, state_arrays,
                         len(tensors), flags, total, 0, 0)
    payload = struct.pack("<%df" % (total * (1 + state_arrays)), *([fill] * (total * (1 + state_arrays))))
    if fed:
        spans = list(federation) + [(0, 0, 0, 0)] * (8 - len(federation))
        payload += struct.pack("<QIIQQ", 4, 0, 0, 2, 0)  # CheckpointFederationRecord: round 4, 2 unmerged updates
        if fed_format >= 5:
            payload += struct.pack("<QQ", 1 if restore_base else 0, 0)  # restore_base_updates, reserved
        if fed_format >= 4:
            payload += b"".join(struct.pack("<4Q", *span) for span in spans)  # RoundGroups
        elif fed_format == 3:
            payload += b"".join(struct.pack("<3Q", *span[:3]) for span in spans)
        payload += struct.pack("<%df" % total, *([fill / 2] * total))  # the anchor
        if restore_base:
            payload += struct.pack("<%df" % total, *([fill / 4] * total))
    body = header + records + payload
    crc = zlib.crc32(body) if crc_ok else 0
    # The harness rewrites the CRC while header byte 48 is 0, and zeroes
    # it in the file it reads; near misses with a wrong CRC set it.
    if not crc_ok:
        body = body[:48] + b"\x01" + body[49:]
    return body + struct.pack("<I", crc)


def checkpoint_corpus():
    model = [("a", [2, 2]), ("b", [3])]
    return {
        "adam_model": checkpoint(model),
        "adam_model_steps_past_version": checkpoint(model, version=3, steps=[4, 5]),
        "adam_model_bad_crc": checkpoint(model, crc_ok=False),
        "sgd_model": checkpoint([("w", [7])], optimizer=1, state_arrays=0),
        "other_shapes": checkpoint([("a", [4]), ("b", [3])]),
        "truncated": checkpoint(model)[:100],
        "federated": checkpoint(model, federation=[(2, 1, 3, 0b111), (5, 4, 4, 0b101)]),
        "federated_restore_base": checkpoint(model, federation=[(2, 1, 3, 0b111)], restore_base=True),
        "federated_format_4": checkpoint(model, federation=[(2, 1, 3, 0b111), (5, 4, 4, 0b101)], fed_format=4),
        "federated_format_3": checkpoint(model, federation=[(2, 1, 3, 0), (5, 4, 4, 0)], fed_format=3),
        "federated_format_2": checkpoint(model, federation=[], fed_format=2),
    }


# fuzz_federation's config bits and per-call records (fuzz_federation.cpp).
THREE, NESTEROV, UNWEIGHTED, ELASTIC, RESTORE = 1, 8, 16, 32, 64
RAW_MAGIC, RAW_MODEL, RAW_FLAGS, RAW_LINEAGE, RAW_ANCHOR_HASH = 1, 2, 4, 64, 128
F_LEAVING, F_HAS_STATE, F_REGROUP = 2, 4, 8
HONEST, RAW_BYTES, ONE_NON_FINITE = 0, 1, 2
N_FED = 11  # the harness's model elements


def fed_input(config, seed=0, host=b"", gather=b"", broadcast=b"", reduce=b"", reform=b""):
    body = bytes([config, seed])
    for stream in (host, gather, broadcast, reduce, reform):
        body += struct.pack("<H", len(stream)) + stream
    return body.rstrip(b"\0")  # the harness reads zeros past the end


def peer(damage=0, magic=0, round=0, updates=0, anchor_hash=0, nonce=0, lineage=0, flags=0, host=0):
    """One other member's record of an allgather: damage mask, then its 104-byte header (model, every_ms and
    reserved zero: fixed up unless the mask says)."""
    return struct.pack("<H6Q40xIIII", damage, magic, round, updates, anchor_hash, nonce, lineage, 0, flags, host, 0)


def gather(*peers, fail=False):
    return bytes([1 if fail else 0]) + b"".join(peers)


def op(updates=0, seed=0, nan=False, leave=False):
    return bytes([updates | seed << 3 | (0x40 if nan else 0) | (0x80 if leave else 0)])


def restore_rec(round, lineage=1, flags=0, anchor=1, spans=()):
    """fuzz_federation.cpp's restore record: this host's id, the anchor all `anchor` eighths, spans of
    (group byte, length, members byte)."""
    rec = struct.pack("<H", round) + bytes([lineage, 0, flags]) + bytes([anchor]) * N_FED
    if flags & 16:
        rec += bytes([anchor // 2]) * N_FED  # the momentum
    rec += bytes([len(spans)]) + b"".join(bytes([g, length - 1, m]) for g, length, m in spans)
    return rec


def federation_corpus():
    join = op()
    rounds = op(3, 1) + op(2, 5) + op(4, 2)
    honest_peer = peer(updates=2)
    honest = bytes([HONEST << 1])
    return {
        # Fresh groups: rank 0's weights become the anchor, then rounds.
        "two_rounds": fed_input(0, 3, host=join + rounds, gather=gather(peer()) + gather(honest_peer) * 3,
                                reduce=bytes([0]) + bytes(range(1, 12))),
        "three_nesterov_rank2": fed_input(THREE | 2 << 1 | NESTEROV, 7, host=join + rounds,
                                          gather=gather(peer(), peer()) + gather(honest_peer, peer(updates=5)) * 3),
        "unweighted_rank1": fed_input(UNWEIGHTED | 1 << 1, 9, host=join + rounds + op(leave=True)),
        # Resumed from a source of a higher round (7), with its record;
        # this host restored at round 5 with its weights and a momentum.
        # Rounds 6 and 7 by a group without this host (host 1 alone): its
        # drift is rebased; with it: merged already.
        "resume_older_checkpoint_rebased": fed_input(THREE | RESTORE | NESTEROV, 1,
                                                     host=restore_rec(5, flags=1 | 4 | 16,
                                                                      spans=((1, 3, 0b11), (2, 2, 0b111))) +
                                                     join + rounds,
                                                     gather=gather(peer(flags=F_HAS_STATE, round=2), peer()) +
                                                     gather(honest_peer, honest_peer) * 3,
                                                     broadcast=honest + bytes(range(N_FED)) + honest +
                                                     bytes([1, 3, 0x23]) + honest * 2 + bytes(N_FED)),
        "resume_older_checkpoint_merged": fed_input(RESTORE, 2, host=restore_rec(5, flags=4, spans=((1, 5, 0b11),)) +
                                                    join + op(1, 1),
                                                    gather=gather(peer(flags=F_HAS_STATE, round=2)) +
                                                    gather(honest_peer),
                                                    broadcast=honest + bytes(N_FED) + honest + bytes([1, 3, 0x33])),
        "resume_record_damaged": fed_input(RESTORE, 2, host=restore_rec(4) + join,
                                           gather=gather(peer(flags=F_HAS_STATE, round=3)),
                                           broadcast=honest + bytes(N_FED) + bytes([RAW_BYTES << 1]) +
                                           struct.pack("<4Q", 0, 1, 9, 3)),
        "unrelated_lineages": fed_input(THREE | RESTORE | ELASTIC, 4, host=restore_rec(6) + join,
                                        gather=gather(peer(damage=RAW_LINEAGE, flags=F_HAS_STATE, round=9,
                                                           lineage=0x22bb), peer(flags=F_HAS_STATE))),
        # An elastic group: a round fails at the very end of its allreduce
        # here (completed elsewhere), the group re-forms, and the source's
        # record shows the round completed in the failed round's group.
        "elastic_failed_allreduce": fed_input(ELASTIC, 5, host=join + op(3, 2) + join + op(1, 1),
                                              gather=gather(peer()) + gather(honest_peer) +
                                              gather(peer(flags=F_HAS_STATE, round=1)) + gather(honest_peer),
                                              broadcast=honest + honest + bytes(N_FED) + honest + bytes([1, 1, 0x10]),
                                              reduce=bytes([2]) + bytes(N_FED), reform=bytes([0, 1, 2, 0])),
        "elastic_regroup_new_rank": fed_input(ELASTIC | THREE, 6, host=join + op(2, 3) + join + op(2, 3),
                                              gather=gather(peer(), peer()) +
                                              gather(peer(flags=F_REGROUP), honest_peer) + gather(peer(), peer()),
                                              reform=bytes([0, 0x04 | 0x10])),
        "peer_leaves": fed_input(THREE | 1 << 1, 8, host=join + op(2, 1),
                                 gather=gather(peer(), peer()) + gather(honest_peer, peer(flags=F_LEAVING))),
        # Anchors that differ at a round: rank 0's is broadcast.
        "anchor_repair": fed_input(1 << 1 | NESTEROV, 10, host=join + op(2, 4) + op(1, 1),
                                   gather=gather(peer()) +
                                   gather(peer(damage=RAW_ANCHOR_HASH, anchor_hash=77, updates=1)),
                                   broadcast=honest + bytes(N_FED) + honest * 3),
        "raw_peer_contributions": fed_input(0, 11, host=join + op(2, 2), gather=gather(peer()) + gather(honest_peer),
                                            reduce=bytes([RAW_BYTES << 2]) + struct.pack("<11f", *([1e38] * N_FED))),
        "bad_magic_and_model": fed_input(THREE, 12, host=join,
                                         gather=gather(peer(damage=RAW_MAGIC, magic=1), peer(damage=RAW_MODEL))),
        "unknown_flags": fed_input(0, 13, host=join, gather=gather(peer(damage=RAW_FLAGS, flags=1 << 9))),
        "non_finite_weights": fed_input(THREE, 14, host=join + op(1, 1, nan=True), gather=gather(peer(), peer())),
        # Rank 0 of a fresh group sends an anchor with a NaN (its header
        # said finite): every member refuses the join.
        "peer_anchor_non_finite": fed_input(1 << 1, 17, host=join + op(1, 1), gather=gather(peer()),
                                            broadcast=bytes([ONE_NON_FINITE << 1]) + bytes(N_FED) + bytes([3])),
        "reform_paused_then_refused": fed_input(ELASTIC, 15, host=join, reform=bytes([2, 1, 3])),
        "engine_failures": fed_input(0, 16, host=join + op(1, 1), gather=gather(peer()) + gather(honest_peer),
                                     reduce=bytes([1])),
    }


def main():
    out = os.path.join(HERE, "corpus")
    seg = {
        "minimal": segment([("w", [4])]),
        "two_tensors_populated": segment([("fc1.weight", [4, 2]), ("fc1.bias", [3])], workers=2, buffers=2, cap=4,
                                         optimizer=3, populate=True),
        "four_dims_cuda": segment([("conv", [2, 3, 1, 2])], workers=1, buffers=2, cap=2, optimizer=2, backend=2,
                                  populate=True),
    }
    near_misses = {
        "foreign": bytes([0x5A]) * 4096,
        "unpublished": seg["minimal"][:8] + bytes(4) + seg["minimal"][12:SWITCH_AT] + b"\x01" +
                       seg["minimal"][SWITCH_AT + 1:],
        # The harness sets the current version while its switch byte is 0.
        "other_version": seg["minimal"][:8] + struct.pack("<I", LAYOUT_VERSION + 1) + seg["minimal"][12:SWITCH_AT] +
                         b"\x01" + seg["minimal"][SWITCH_AT + 1:],
        "truncated": seg["minimal"][:4096],
    }
    files = {"fuzz_validate_segment": {**seg, **near_misses}, "fuzz_requests": requests_corpus(),
             "fuzz_checkpoint": checkpoint_corpus(), "fuzz_federation": federation_corpus()}
    for target, items in files.items():
        d = os.path.join(out, target)
        os.makedirs(d, exist_ok=True)
        # found_*: inputs a fuzzer found, kept byte for byte (they are not
        # regenerated here: each needs the harness state it was found in).
        for name in os.listdir(d):
            if not name.startswith("found_"):
                os.remove(os.path.join(d, name))
        for name, data in items.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
