"""The text of the cards (see `cards.py`): prompts and model answers written for this course,
after the questions of seed 004 (its appendix A, its self-check list and its open questions).
{name} fields are figures computed from the chapters' functions when a card is shown."""

TEXTS = [
    # ---- whiteboard questions (seed 004, appendix A) -----------------------------------------
    dict(id="whiteboard-1", kind="whiteboard", number=1, topic="moe", links=((7, "section 5"),),
         prompt="Derive, on a whiteboard, how many bytes one rank sends for one expert-parallel "
                "MoE layer (N tokens per rank, hidden size H, top-K routing, P ranks), and "
                "explain why every routed token crosses the network twice.",
         answer="A rank holds N tokens, so N K (token, expert) assignments. With the experts "
                "spread evenly and routing even, (P - 1)/P of them point at another rank.\n"
                "Dispatch: each such assignment sends the token's row, H values, to the "
                "expert's rank (2H bytes in BF16).\n"
                "Combine: the expert's output must come back, because the weighted sum over the "
                "K experts, the residual connection and the next layer all live on the token's "
                "own rank. Same rows, same size: the second crossing.\n"
                "Forward: 2 x (P - 1)/P x K N H x 2 bytes = 4 (P - 1)/P K N H.\n"
                "Backward: the gradient of an all-to-all is the same all-to-all with send and "
                "receive swapped, so both crossings happen again: 8 (P - 1)/P K N H per step.\n"
                "With DeepSeek-V3's sizes sent flat (H = {H}, K = {K}, N = 4096, P = 64): {fwd} "
                "forward, {both} per step, about {per_token} per token. (The source's 917.5 KB "
                "multiplies by BF16's 2 bytes twice.)\n"
                "DeepSeek-V3 itself does not send flat: its routing limits a token to 4 nodes, "
                "and DeepEP sends the token over InfiniBand once per target node, then forwards "
                "it over NVLink to that node's experts: at most 4 rows per token on InfiniBand "
                "instead of K = 8 (the drill moe-node-limited).",
         key_points=(("N K assignments, (P - 1)/P of them remote", ("(p - 1)/p", "p-1", "remote")),
                     ("dispatch sends the rows to the experts", ("dispatch",)),
                     ("combine brings the outputs back to the token's rank", ("combine", "back")),
                     ("4 K N H bytes forward in BF16", ("4knh", "4 k n h", "4 x k", "4k")),
                     ("backward doubles it: 8 K N H", ("backward", "again", "8knh", "8 k n h",
                                                       "8 (p - 1)/p")))),
    dict(id="whiteboard-2", kind="whiteboard", number=2, topic="faults",
         links=((0, "section 4"), (9, "section 2")),
         prompt="A training job on a thousand GPUs has stopped making progress inside a "
                "collective: no error, no exit. Walk through how you find the cause.",
         answer="1. Keep the evidence before restarting: dump every rank's Python stack "
                "(py-spy dump --pid), and the collective each rank last issued and finished "
                "(torch's flight recorder; labkit's hang diagnosis does the same for the course's "
                "worlds).\n"
                "2. Line the ranks up by collective sequence number, not by time: almost all "
                "will wait in collective #k. The odd one out is the lead. If it sits in a "
                "different collective, or in one with another shape, dtype or group, the "
                "program diverged (a deadlock: it will never arrive; read its code path). If it "
                "is computing, loading data or writing, and a second dump shows it moving, it is "
                "a straggler: slow, not stuck; per-rank step times confirm it.\n"
                "3. Then the host of that rank: the kernel log for GPU Xid errors, the PCIe link "
                "width and speed, clocks and thermal or power throttling, ECC counters "
                "(nvidia-smi -q; external: NVIDIA's documentation).\n"
                "4. If every rank waits in the same collective and no host is sick, the network: "
                "NCCL_DEBUG=INFO for the rings and transports in use, InfiniBand port counters "
                "(symbol errors, link downs), and bisection: NCCL_P2P_DISABLE=1 (inside a node) "
                "or NCCL_IB_DISABLE=1 (between nodes) to see which path the hang follows.\n"
                "5. Make the next one cheaper: collective timeouts with asynchronous error "
                "handling (TORCH_NCCL_ASYNC_ERROR_HANDLING), so a hang becomes an error, the job "
                "restarts without the bad node and resumes from the last checkpoint.",
         key_points=(("dump every rank's stack before killing", ("py-spy", "stack", "dump")),
                     ("find the one rank not in the collective the others wait in",
                      ("odd", "one rank", "missing", "sequence")),
                     ("tell deadlock (never arrives) from straggler (slow)",
                      ("straggler", "deadlock", "slow")),
                     ("check that host's hardware: Xid, PCIe, throttling",
                      ("xid", "pcie", "dmesg", "throttl", "ecc")),
                     ("then the network: NCCL_DEBUG, IB counters, disable P2P/IB to bisect",
                      ("nccl_debug", "ib_disable", "p2p_disable", "infiniband", "network")),
                     ("timeouts turn a hang into an error and a restart from checkpoint",
                      ("timeout", "checkpoint", "restart")))),
    dict(id="whiteboard-3", kind="whiteboard", number=3, topic="faults",
         links=((2, "section 6"), (8, "sections 4 and 7"), (9, "section 5")),
         prompt="The loss jumps by an order of magnitude in one step, mid-training. What can "
                "cause it, and how would you build a guard that detects it and rolls back "
                "automatically?",
         answer="Causes. Data: a bad batch (garbage, a long run of one repeated token, an "
                "extreme length). Numerics: FP16 overflow (an attention score past 65504 becomes "
                "inf, the softmax NaN, and backward spreads it), loss-scale trouble, sums kept in "
                "16 bits. Optimisation: a learning rate too high for the current curvature, "
                "Adam's second moment stale for rarely seen features. Hardware: silent data "
                "corruption (a flipped bit in a weight or a gradient).\n"
                "Prevention: BF16 instead of FP16 (or dynamic loss scaling), FP32 wherever values "
                "are summed, gradient clipping, data filtering.\n"
                "Detection: watch the loss, the global gradient norm and per-layer activation "
                "norms against a sliding window (the source material's rule: above 5 x the mean "
                "of the last 100 steps); a non-finite norm always trips it.\n"
                "Response: skip the update (never let that gradient reach the optimizer), roll "
                "back to the last good checkpoint if the weights were already hit, skip or "
                "quarantine the offending batch indices when replaying (the data cursor is part "
                "of the checkpoint, so the replay is exact otherwise), and alert. Frequent, cheap "
                "(asynchronous) checkpoints make the rollback short.\n"
                "Test the guard both ways: it must fire on an injected bad batch and stay quiet "
                "on a clean run's noise (measure its false alarms).",
         key_points=(("bad data", ("bad data", "bad batch", "bad sample", "corrupt",
                                   "outlier", "data quality", "poisoned")),
                     ("FP16 overflow / numerics", ("fp16", "overflow", "inf", "nan")),
                     ("BF16 and FP32 accumulation", ("bf16",)),
                     ("gradient clipping or skipping the step", ("clip", "skip")),
                     ("a sliding-window detector on loss or norms",
                      ("window", "moving average", "rolling", "z-score", "z score", "ema")),
                     ("roll back to a checkpoint and quarantine the batch",
                      ("rollback", "roll back", "checkpoint", "quarantine")))),

    # ---- the ten self-check questions (seed 004, section 6.2) --------------------------------
    dict(id="self-check-1", kind="self-check", number=1, topic="memory",
         links=((3, "section 6"), (6, "section 2, ZeRO-3 inside a pipeline")),
         prompt="What does ZeRO stage 3 cost in a job that also uses pipeline parallelism, "
                "and how do torch's pipelining and torchtitan run FSDP (ZeRO-3) with PP?",
         answer="It depends on when the stage reshards. Resharding at every microbatch (the "
                "textbook ZeRO-3): a pipeline pushes m microbatches through each stage per "
                "step, so each block is all-gathered in every forward and every backward and "
                "its gradients reduce-scattered every backward: about 3 m Psi bytes against "
                "2 Psi for stage 1 ({ratio} times more at m = 32), over the data-parallel links "
                "that usually cross nodes; the rank holds only 1/dp of its weights.\n"
                "Resharding once per step: torch's pipelining stage turns FSDP's "
                "reshard-after-backward and gradient sync off for every microbatch but the last "
                "(stage.py), and torchtitan does not reshard after forward when PP is on. Then "
                "the weights cost one all-gather and one reduce-scatter per step, what ZeRO-1 "
                "sends, and the price is memory: the whole gathered weights and unsharded "
                "gradients are held through the step, so the peak is ZeRO-1's. It is a "
                "trade-off, not a ban: bytes per microbatch against memory held.",
         key_points=(("stage 3 gathers weights before every use", ("gather",)),
                     ("per microbatch: 3m Psi against 2 Psi", ("3m", "3 m", "times m")),
                     ("or keep them gathered: once per step", ("once per step", "per step",
                                                               "last microbatch")),
                     ("then ZeRO-1's bytes", ("zero-1", "stage 1", "same bytes")),
                     ("the price: holding the gathered weights", ("memory", "hold", "peak")))),
    dict(id="self-check-2", kind="self-check", number=2, topic="moe",
         links=((7, "introduction and section 5"),),
         prompt="In what sense is a mixture-of-experts layer's computation sparse while its "
                "communication is dense?",
         answer="Compute: each token runs through K of the E experts, so its FLOPs grow with K, "
                "not with E; the parameters can grow E-fold for the same cost per token.\n"
                "Communication: with the experts spread over P ranks, every token's row must "
                "travel to the ranks of its K experts and back, in every MoE layer: (P - 1)/P "
                "of its K rows leave the rank whatever E is. Every rank talks to every other "
                "rank (an all-to-all), and the bytes per rank do not shrink as E grows. An "
                "expert does little arithmetic per byte moved, so the layer is easily "
                "network-bound (DeepSeek-V3's report puts its cross-node ratio near 1:1; "
                "external).",
         key_points=(("each token uses only K of E experts",
                      ("k of", "top-k", "topk", "k experts")),
                     ("every token's row goes to its experts and back", ("dispatch", "back",
                                                                         "combine")),
                     ("all-to-all between every pair of ranks", ("all-to-all", "all to all")),
                     ("bytes do not shrink with E", ("not with e", "independent", "whatever e",
                                                     "does not shrink")))),
    dict(id="self-check-3", kind="self-check", number=3, topic="moe", links=((7, "section 5"),),
         prompt="Show that in the forward pass of an expert-parallel MoE layer each routed "
                "token crosses the network twice.",
         answer="Dispatch: the token's row goes from its own rank to the rank of each chosen "
                "expert. Combine: the expert's output must return to the token's rank, where "
                "the gate weights are applied, the K outputs are summed into the residual "
                "stream and the next layer runs. Two all-to-alls, the same rows each way: "
                "4 (P - 1)/P K N H bytes forward in BF16, and twice that with backward "
                "(H = {H}, K = {K}: about {per_token} per token per layer and step).",
         key_points=(("dispatch: to the expert's rank", ("dispatch",)),
                     ("combine: back to the token's rank", ("combine", "back")),
                     ("the token's rank holds the residual and the next layer",
                      ("residual", "next layer", "weighted")))),
    dict(id="self-check-4", kind="self-check", number=4, topic="moe",
         links=((7, "sections 3 and 6"),),
         prompt="What is a hot expert, and what does it do to the other GPUs and to the "
                "network?",
         answer="A router reinforces itself: an expert that gets more tokens trains more and "
                "scores higher, so a few experts can end up with a large share (60% on one GPU "
                "in the incident the source material recounts).\n"
                "GPUs: that expert's rank receives far more rows and computes longer; combine is "
                "a collective, so every other rank waits for it: the layer takes max/mean times "
                "the balanced time. With a capacity limit, its excess assignments are dropped "
                "instead, and the model loses what they would have learnt.\n"
                "Network: many senders converge on one receiver (incast); its links saturate, "
                "and on a lossless fabric the congestion spreads upstream as pause frames slow "
                "unrelated traffic too (external: RDMA/PFC behaviour).\n"
                "Remedies: an auxiliary balance loss, DeepSeek-V3's bias on the selection "
                "scores, capacity with headroom, more and smaller experts, shared experts.",
         key_points=(("router feedback piles tokens on one expert", ("router", "share", "popular")),
                     ("other ranks wait for it: step time ~ max/mean", ("wait", "max", "slow")),
                     ("capacity drops tokens", ("drop", "capacity")),
                     ("incast / congestion on its links", ("incast", "congest", "pfc", "link")),
                     ("balance loss or bias", ("aux", "balanc", "bias")))),
    dict(id="self-check-5", kind="self-check", number=5, topic="moe", links=((7, "section 3"),),
         prompt="Why do DeepSeek-V3-style models add shared experts and use many fine-grained "
                "experts?",
         answer="Shared experts: every token goes through them, so knowledge every token needs "
                "is learnt once instead of again in many routed experts. A shared expert is an "
                "ordinary dense FFN: no router, no capacity, no imbalance, no all-to-all, and "
                "its compute can run while the routed tokens are on the network.\n"
                "Fine-grained experts: split the FFN into many small experts (256 routed, 8 per "
                "token, in DeepSeek-V3) for the same compute per token. Far more combinations "
                "let experts specialise; a popular kind of token spreads over several experts "
                "instead of overloading one. The price is more, smaller messages, which "
                "DeepSeek-V3 contains with node-limited routing (at most 4 nodes per token) and "
                "FP8 dispatch.",
         key_points=(("shared: common knowledge learnt once", ("common", "once", "every token")),
                     ("shared expert needs no routing or all-to-all", ("no router", "dense",
                                                                       "no all-to-all")),
                     ("fine-grained: more combinations, specialisation", ("combination",
                                                                          "speciali")),
                     ("load spreads over more experts", ("balanc", "spread")),
                     ("cost: more, smaller messages", ("messages", "small")))),
    dict(id="self-check-6", kind="self-check", number=6, topic="faults",
         links=((0, "section 4"), (9, "sections 2 and 3")),
         prompt="When a large job hangs, how do stack dumps tell a true deadlock from a "
                "straggler that holds everyone up?",
         answer="Dump every rank's stack, twice, some seconds apart. Nearly every rank waits "
                "inside the same collective (same sequence number). Look at the rest:\n"
                "Deadlock: the odd rank waits in a different collective (an earlier or later "
                "one, another group, another shape), or waits on something that will never "
                "come; its stack is the same in both dumps. It will never arrive: read its code "
                "path (a conditional collective, an exception on one rank).\n"
                "Straggler: the odd rank is computing, loading data or doing I/O, and its stack "
                "moves between dumps; per-rank step times show it slow every step, and the "
                "others' wait time grows with its lag. It arrives, late: look at its hardware "
                "(throttling, PCIe, Xid) or its data.\n"
                "The sequence numbers line the ranks up by number, not by time. They say where "
                "each rank is, not that a collective is done everywhere: completion is per rank, "
                "so a rank that returned from collective #k says nothing about its peers.",
         key_points=(("compare every rank's stack, taken twice", ("twice", "two dumps",
                                                                  "again", "stack")),
                     ("deadlock: different collective, never arrives", ("different collective",
                                                                        "never")),
                     ("straggler: still working, slow", ("compute", "moving", "slow")),
                     ("per-rank step times / sequence numbers", ("step time", "sequence")))),
    dict(id="self-check-7", kind="self-check", number=7, topic="dp", links=((2, "section 6"),),
         prompt="FP16 against BF16: why does BF16 nearly remove the loss spikes caused by "
                "overflow in pre-training?",
         answer="FP16 has 5 exponent bits: its largest finite value is 65504. Large activations, "
                "attention scores computed before scaling, or gradients summed over ranks pass "
                "it, become inf, and the softmax or the next operation turns inf into NaN. FP16 "
                "also needs loss scaling against underflow (GradScaler skips a step and halves "
                "the scale when it overflows).\n"
                "BF16 has 8 exponent bits, the range of FP32 (about 3.4e38): nothing in a "
                "healthy model gets near it, so overflow spikes and loss scaling go away. It "
                "pays with precision, 8 significant bits (0.0078 between values near 1), so "
                "sums stay in FP32: master weights, gradient accumulators, norms, optimizer "
                "states. BF16 removes overflow spikes, not spikes from bad data or a too-high "
                "learning rate.",
         key_points=(("FP16 max 65504 (5 exponent bits)", ("65504", "5 exponent", "range")),
                     ("BF16 has FP32's exponent (8 bits)", ("8 exponent", "same exponent",
                                                           "fp32's range", "3.4e38", "1e38")),
                     ("no loss scaling needed", ("loss scal", "gradscaler")),
                     ("fewer mantissa bits: accumulate in FP32", ("precision", "mantissa",
                                                                 "fp32")))),
    dict(id="self-check-8", kind="self-check", number=8, topic="moe", links=((7, "section 7"),),
         prompt="Name three things DeepEP does that a plain all-to-all through a general "
                "collective library does not.",
         answer="(External: DeepEP's README, github.com/deepseek-ai/DeepEP; not measurable on "
                "this course's CPUs.)\n"
                "1. Kernels written for MoE dispatch and combine, shaped by DeepSeek-V3's "
                "node-limited routing: a token crosses InfiniBand once per target node and is "
                "forwarded inside the node over NVLink (asymmetric-domain forwarding), reaching "
                "close to the links' bandwidth (its published table is in chapter 7).\n"
                "2. Low precision on the wire: FP8 dispatch with per-block scales, BF16 combine, "
                "so dispatch moves about half the bytes (H + 4H/128 instead of 2H).\n"
                "3. Low-latency kernels for inference decoding (pure RDMA) with a hook-based "
                "overlap of communication and computation that occupies no streaming "
                "multiprocessors, and control over how many SMs the throughput kernels use.",
         key_points=(("kernels for dispatch/combine with NVLink-to-RDMA forwarding",
                      ("nvlink", "rdma", "forward")),
                     ("FP8 dispatch", ("fp8",)),
                     ("overlap / low latency without occupying SMs", ("overlap", "sm",
                                                                     "latency")))),
    dict(id="self-check-9", kind="self-check", number=9, topic="checkpoint",
         links=((8, "sections 6 and 7"),),
         prompt="What is an asynchronous checkpoint, and how does it keep training from "
                "stopping for the write?",
         answer="It splits the save in two. The copy: every tensor is copied into host memory set "
                "aside for it (on GPUs a device-to-host copy over PCIe, seconds for tens of GB); "
                "training waits only for this. The write: a background thread serialises the "
                "copy and writes it to storage while training goes on, then publishes it "
                "(manifest committed last, so a crash never leaves a torn snapshot).\n"
                "Rules: the copy must finish before the next step changes the tensors (else the "
                "snapshot mixes two steps); at most one write in flight; it costs one more copy "
                "of the state in host RAM. torch's dcp.async_save works this way.\n"
                "Why it matters: the stall C drops from the write time to the copy time, and the "
                "waste at Young's interval goes like sqrt(2C/M).",
         key_points=(("copy to host memory first; training waits only for that",
                      ("copy", "host", "cpu memory", "ram")),
                     ("write in a background thread", ("background", "thread")),
                     ("copy before the next step changes the tensors", ("next step", "before")),
                     ("one write in flight, extra host memory", ("one write", "memory")))),
    dict(id="self-check-10", kind="self-check", number=10, topic="faults",
         links=((9, "GPU-only reference: Xid codes"),),
         prompt="The driver log of a node shows NVIDIA Xid 79. What happened, and what do you "
                "do?",
         answer="(External: NVIDIA's Xid error documentation; there is no GPU in this course's "
                "CPU runs.) Xid 79 means the GPU has fallen off the bus: the driver can no "
                "longer reach it over PCIe. Causes are hardware: the GPU itself, its PCIe link "
                "or riser, power or heat. Every process using that GPU is lost; the other ranks "
                "of the job hang in their next collective until a timeout turns it into an "
                "error. Do not retry on that node: drain it, reset or replace the GPU, and "
                "restart the job without it from the last checkpoint (at a smaller world size "
                "if no spare is ready). Other codes worth knowing from the same page: 48 "
                "(double-bit ECC error), 74 (NVLink error), 94/95 (contained/uncontained ECC "
                "errors).",
         key_points=(("the GPU fell off the bus (PCIe)", ("fallen off", "fell off", "bus",
                                                          "pcie")),
                     ("hardware failure: the job's other ranks hang", ("hardware", "hang")),
                     ("drain the node, restart from checkpoint without it",
                      ("drain", "replace", "checkpoint", "exclude")))),

    # ---- the three open questions (seed 004, section 6.3) ------------------------------------
    dict(id="open-1", kind="open", number=1, topic="moe",
         links=((7, "sections 3 and 5"), (5, "section 4")),
         prompt="DeepSeek-V3 has 1 shared and 256 routed experts, 8 per token. Can the shared "
                "expert's computation hide the routed experts' all-to-all entirely? Estimate per "
                "token, then say how DeepSeek-V3 actually hides it.",
         answer="Per token, forward: one expert costs 2 x 3 x H x 2048 = {flop}, {shared_us} us "
                "at {peak} (H100 BF16 dense, datasheet; external). Dispatch in FP8 sends a "
                "{row}-byte row to at most {nodes} nodes: {wire_us} us over one {ib} "
                "InfiniBand port (external). The shared expert covers about {share} of the "
                "dispatch alone, so the premise fails. The routed experts ({routed_us} us) are "
                "comparable to the network time: DeepSeek-V3's report gives a computation-to-"
                "communication ratio near 1:1.\n"
                "What it does instead (DeepSeek-V3 report, section 3.2): DualPipe pairs a "
                "forward chunk and a backward chunk of different microbatches, so that one's "
                "attention and expert compute runs while the other's dispatch and combine are "
                "on the network; a few SMs are set aside for communication; node-limited "
                "routing caps the InfiniBand bytes; FP8 dispatch halves them. The shared expert "
                "helps fill the gap, it does not close it.",
         key_points=(("compute time against wire time, per token", ("flop", "us", "per token")),
                     ("shared expert alone is too small", ("too small", "not enough",
                                                           "fraction", "fails")),
                     ("overlap microbatches (DualPipe)", ("dualpipe", "microbatch",
                                                          "two streams", "overlap")),
                     ("node-limited routing, FP8 dispatch", ("node", "fp8")))),
    dict(id="open-2", kind="open", number=2, topic="faults",
         links=((1, "section 3"), (9, "sections 2 and 3")),
         prompt="One slightly bent fibre corrupts 1 packet in 10,000. How can that stall "
                "thousands of GPUs, and how do modern fabrics defend against it?",
         answer="Count first (chapter 1's ring, 4 KB packets): a 1 GB all-reduce over 1024 ranks "
                "pushes {packets} packets through every link of the ring, so the bad link loses "
                "about {losses} of them per all-reduce; even one {chunk} ring step loses a packet "
                "{per_message} of the time. Reliable RDMA recovers a loss by resending from the "
                "lost packet on (go-back-N), or after a transport timeout when nothing follows "
                "it; meanwhile that ring step stalls, and a collective is as slow as its slowest "
                "link, so every rank waits, every step.\n"
                "On a lossless Ethernet fabric (RoCE with PFC), the backlog behind the slow link "
                "fills switch buffers and sends pause frames upstream; paused ports stop "
                "unrelated flows too (head-of-line blocking), pauses can spread across the tree "
                "and, with cyclic buffer dependencies, deadlock it. (Fabric behaviour: external.)\n"
                "Defences: watch link error counters and drain links before they fail; "
                "ECN-based congestion control so senders slow down before PFC triggers; PFC "
                "watchdogs; adaptive routing; and newer transports that trim packets or "
                "retransmit selectively instead of going back N; at the job level, timeouts "
                "and straggler detection.",
         key_points=(("count packets through the bad link per collective", ("packet", "per")),
                     ("retransmission stalls the ring step; all ranks wait",
                      ("retransmi", "go-back", "wait", "slowest")),
                     ("PFC pause frames spread congestion", ("pfc", "pause", "backpressure")),
                     ("ECN congestion control, monitoring, adaptive routing",
                      ("ecn", "monitor", "counter", "adaptive")))),
    dict(id="open-3", kind="open", number=3, topic="dp", links=((2, "sections 4 and 6"),),
         prompt="Gradients are accumulated over 8 microbatches in a BF16 buffer that already "
                "holds about 1.0; each microbatch adds 1e-5. What is the buffer after 8 steps, "
                "why, and why must accumulators be FP32?",
         answer="BF16 keeps 8 significant bits: near 1.0 its values are {spacing} apart. Adding "
                "1e-5 means aligning it to 1.0's exponent, which shifts its bits about 17 places "
                "right, past the 8 kept; rounding to nearest gives 1.0 again. Every addition is "
                "lost: after 8 steps the BF16 buffer holds {bf16_sum} (FP32, with values "
                "{fp32_spacing} apart near 1, gives {fp32_sum}). This is absorption, not "
                "underflow: 1e-5 alone is a perfectly good BF16 number; it disappears only next "
                "to a much larger one.\n"
                "So accumulate where the sum is large compared with each term in FP32: gradient "
                "accumulation buffers, all-reduce sums, master weights (an update of lr x grad "
                "is tiny next to the weight), norms, optimizer states. Alternatives are "
                "compensated (Kahan) summation or stochastic rounding.",
         key_points=(("BF16 spacing near 1 is 2^-7", ("2^-7", "0.0078", "8 bits",
                                                      "8 significant")),
                     ("the small term is rounded away", ("round", "absorb", "lost", "swamp")),
                     ("rounding, not underflow", ("not underflow", "not an underflow",
                                                  "no underflow", "rather than underflow")),
                     ("accumulate in FP32", ("fp32",)))),
]
