"""Speculative decoding: drafting (n-gram, draft model), the verification program that scores a drafted chunk
and keeps the state after every prefix, and the policy that decides when drafting pays."""
