//! A small seeded PRNG (xoshiro256**, seeded through SplitMix64): the same seed gives the
//! same numbers on every machine and build, and nothing outside this file decides them.

/// xoshiro256** (Blackman and Vigna): fast, 256 bits of state, good enough for fuzzing.
#[derive(Clone, Debug)]
pub struct Rng([u64; 4]);

/// One step of SplitMix64: spreads a seed (or any integer) over 64 well-mixed bits.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let a = splitmix64(seed);
        let b = splitmix64(a);
        let c = splitmix64(b);
        let d = splitmix64(c);
        Rng([a, b, c, d])
    }

    /// The generator of one case: a function of the run's seed, the program and the
    /// case's index alone, so that any case can be made again without the ones before it.
    pub fn for_case(seed: u64, program: usize, index: u64) -> Self {
        Rng::new(splitmix64(seed ^ splitmix64(program as u64 + 1)) ^ splitmix64(index))
    }

    pub fn u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    pub fn u8(&mut self) -> u8 {
        (self.u64() >> 56) as u8
    }

    pub fn u16(&mut self) -> u16 {
        (self.u64() >> 48) as u16
    }

    pub fn u32(&mut self) -> u32 {
        (self.u64() >> 32) as u32
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.u64() >> 32) * n as u64) >> 32) as usize
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent as usize
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    /// An element of `xs` drawn by its weight.
    pub fn weighted<'a, T>(&mut self, xs: &'a [(u32, T)]) -> &'a T {
        let total: u32 = xs.iter().map(|(w, _)| w).sum();
        let mut r = self.below(total as usize) as u32;
        for (w, x) in xs {
            if r < *w {
                return x;
            }
            r -= w;
        }
        &xs[xs.len() - 1].1
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u8()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_numbers_every_time() {
        let a: Vec<u64> = (0..4).map(|i| Rng::for_case(7, 1, i).u64()).collect();
        let b: Vec<u64> = (0..4).map(|i| Rng::for_case(7, 1, i).u64()).collect();
        assert_eq!(a, b);
        assert_ne!(Rng::for_case(7, 1, 0).u64(), Rng::for_case(7, 2, 0).u64());
        assert_ne!(Rng::for_case(7, 1, 0).u64(), Rng::for_case(8, 1, 0).u64());
    }

    #[test]
    fn below_stays_below_and_reaches_every_value() {
        let mut r = Rng::new(1);
        let mut seen = [false; 6];
        for _ in 0..1000 {
            let x = r.below(6);
            seen[x] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
