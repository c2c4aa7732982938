"""Tandem: speculative decoding split across a network.

Glossary, used the same way everywhere:
  proposed  - tokens the drafter offers for one verify round (k of them, k may be 0)
  accepted  - the leading proposed tokens the target agrees with
  rejected  - the first proposed token the target disagrees with, and all after it
  bonus     - the token the target adds after the accepted ones: sampled from the target's
              distribution when all k are accepted, or from the residual at the first rejection
              (then often called the corrected token)
  p / q     - target / draft probabilities after the same logits processing
"""
