"""The top frames of a py-spy speedscope profile, a thread at a time: inclusive and self shares.

Usage: python bench/pyspy_top.py PROFILE.json [--top 20] [--min-samples 50]
Prints, for every sampled thread with at least --min-samples samples, the frames holding the largest
share of its samples inclusively (the frame anywhere on the stack) and as the innermost frame.
"""

import argparse
import json
from collections import Counter


def frame_name(frame: dict) -> str:
    where = frame.get("file", "").rsplit("/", 2)[-2:]
    return f"{frame['name']} ({'/'.join(where)}:{frame.get('line', '?')})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-samples", type=int, default=50)
    args = ap.parse_args()
    data = json.load(open(args.profile))
    frames = data["shared"]["frames"]
    for prof in data["profiles"]:
        samples = prof["samples"]  # py-spy weighs each sample by its interval in seconds: count them
        weights = [1] * len(samples)
        total = len(samples)
        if total < args.min_samples:
            continue
        inclusive, inner = Counter(), Counter()
        for stack, w in zip(samples, weights, strict=True):
            for idx in set(stack):
                inclusive[idx] += w
            if stack:
                inner[stack[-1]] += w
        print(f"--- {prof.get('name', '?')}: {total} samples")
        print("  inclusive:")
        for idx, n in inclusive.most_common(args.top):
            print(f"    {n / total:6.1%}  {frame_name(frames[idx])}")
        print("  innermost:")
        for idx, n in inner.most_common(args.top // 2):
            print(f"    {n / total:6.1%}  {frame_name(frames[idx])}")


if __name__ == "__main__":
    main()
