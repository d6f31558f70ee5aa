//! Device meshes, parallel types and teams.

use std::fmt;
use std::str::FromStr;

/// A device (rank) id. Ranks of a run are numbered `0..world_size`.
pub type DeviceId = usize;

/// How a loop axis is executed.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParallelType {
    /// Distributed over the **last** mesh axis.
    DIDx,
    /// Distributed over the second-to-last mesh axis.
    DIDy,
    /// Distributed over the third-to-last mesh axis.
    DIDz,
    /// A host for-loop over chunks of the axis (each chunk may run on its own CUDA stream).
    Stream,
    /// Not parallel: the whole axis is local (the default).
    Serial,
}

impl ParallelType {
    /// Every parallel type, in a fixed order.
    pub const ALL: [ParallelType; 5] = [
        ParallelType::DIDx,
        ParallelType::DIDy,
        ParallelType::DIDz,
        ParallelType::Stream,
        ParallelType::Serial,
    ];

    /// The device parallel types, `DIDx, DIDy, DIDz`.
    pub const DEVICE: [ParallelType; 3] =
        [ParallelType::DIDx, ParallelType::DIDy, ParallelType::DIDz];

    /// True for `DIDx`, `DIDy` and `DIDz`.
    pub fn is_device(self) -> bool {
        matches!(
            self,
            ParallelType::DIDx | ParallelType::DIDy | ParallelType::DIDz
        )
    }

    /// For a device type, how many axes from the end of the mesh shape it names
    /// (`DIDx` = 0, the last axis).
    pub fn device_rank(self) -> Option<usize> {
        match self {
            ParallelType::DIDx => Some(0),
            ParallelType::DIDy => Some(1),
            ParallelType::DIDz => Some(2),
            ParallelType::Stream | ParallelType::Serial => None,
        }
    }

    /// The name used in the text format.
    pub fn name(self) -> &'static str {
        match self {
            ParallelType::DIDx => "DIDx",
            ParallelType::DIDy => "DIDy",
            ParallelType::DIDz => "DIDz",
            ParallelType::Stream => "Stream",
            ParallelType::Serial => "Serial",
        }
    }
}

impl fmt::Display for ParallelType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error for an unknown parallel type name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown parallel type `{0}` (expected one of DIDx, DIDy, DIDz, Stream, Serial)")]
pub struct UnknownParallelType(pub String);

impl FromStr for ParallelType {
    type Err = UnknownParallelType;
    fn from_str(s: &str) -> Result<ParallelType, UnknownParallelType> {
        ParallelType::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownParallelType(s.to_string()))
    }
}

/// Why a mesh could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// The shape has no axes or an axis of extent 0.
    #[error("mesh shape {0:?} is empty or has an axis of extent 0")]
    EmptyShape(Vec<usize>),
    /// The device count does not match the product of the shape.
    #[error("mesh shape {shape:?} holds {expected} devices but {given} were given")]
    CountMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// The product of the shape.
        expected: usize,
        /// The number of device ids given.
        given: usize,
    },
    /// A device id appears twice.
    #[error("device {0} appears more than once in the mesh")]
    DuplicateDevice(DeviceId),
}

/// An N-dimensional array of unique device ids, stored row-major.
///
/// Device parallel types name mesh axes from the end: `DIDx` is the last axis, `DIDy` the one
/// before it, `DIDz` the one before that. The **team** of a device along a parallel type is the
/// slice of the mesh through that device along the type's axis; a device's **team index** is its
/// coordinate on that axis.
///
/// ```
/// use meshflow_ir::{DeviceMesh, ParallelType};
/// let mesh = DeviceMesh::new(vec![2, 3], vec![0, 1, 2, 3, 4, 5]).unwrap();
/// assert_eq!(mesh.team(4, ParallelType::DIDx), Some(vec![3, 4, 5]));
/// assert_eq!(mesh.team(4, ParallelType::DIDy), Some(vec![1, 4]));
/// assert_eq!(mesh.team_index(4, ParallelType::DIDy), Some(1));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    devices: Vec<DeviceId>,
}

impl DeviceMesh {
    /// A mesh of `shape` holding `devices` in row-major order.
    pub fn new(shape: Vec<usize>, devices: Vec<DeviceId>) -> Result<DeviceMesh, MeshError> {
        if shape.is_empty() || shape.contains(&0) {
            return Err(MeshError::EmptyShape(shape));
        }
        let expected = shape
            .iter()
            .try_fold(1usize, |acc, &e| acc.checked_mul(e))
            .ok_or_else(|| MeshError::EmptyShape(shape.clone()))?;
        if expected != devices.len() {
            return Err(MeshError::CountMismatch {
                shape,
                expected,
                given: devices.len(),
            });
        }
        let mut sorted = devices.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(MeshError::DuplicateDevice(w[0]));
        }
        Ok(DeviceMesh { shape, devices })
    }

    /// A mesh of `shape` holding devices `start, start+1, ...` in row-major order.
    pub fn iota(shape: Vec<usize>, start: DeviceId) -> Result<DeviceMesh, MeshError> {
        let count = if shape.is_empty() {
            0
        } else {
            shape.iter().product()
        };
        DeviceMesh::new(shape, (start..start + count).collect())
    }

    /// The shape (extent of every mesh axis).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The devices in row-major order.
    pub fn devices(&self) -> &[DeviceId] {
        &self.devices
    }

    /// The number of mesh axes.
    pub fn ndims(&self) -> usize {
        self.shape.len()
    }

    /// The number of devices.
    pub fn size(&self) -> usize {
        self.devices.len()
    }

    /// The largest device id plus one: the world size a run of this mesh needs.
    pub fn required_world_size(&self) -> usize {
        self.devices.iter().max().map_or(0, |m| m + 1)
    }

    /// True when `device` is in the mesh.
    pub fn contains(&self, device: DeviceId) -> bool {
        self.devices.contains(&device)
    }

    /// The mesh axis a device parallel type maps to (`DIDx` = last axis), or `None` when the mesh
    /// has too few axes or `pt` is not a device type.
    pub fn axis_of(&self, pt: ParallelType) -> Option<usize> {
        let from_end = pt.device_rank()?;
        self.ndims().checked_sub(1 + from_end)
    }

    /// The extent of the mesh axis `pt` maps to.
    pub fn size_of(&self, pt: ParallelType) -> Option<usize> {
        self.axis_of(pt).map(|a| self.shape[a])
    }

    /// The coordinates of `device`, or `None` if it is not in the mesh.
    pub fn coords(&self, device: DeviceId) -> Option<Vec<usize>> {
        let flat = self.devices.iter().position(|&d| d == device)?;
        let mut coords = vec![0; self.ndims()];
        let mut rest = flat;
        for axis in (0..self.ndims()).rev() {
            coords[axis] = rest % self.shape[axis];
            rest /= self.shape[axis];
        }
        Some(coords)
    }

    /// The device at `coords`, or `None` when out of range.
    pub fn at(&self, coords: &[usize]) -> Option<DeviceId> {
        if coords.len() != self.ndims() {
            return None;
        }
        let mut flat = 0usize;
        for (axis, &c) in coords.iter().enumerate() {
            if c >= self.shape[axis] {
                return None;
            }
            flat = flat * self.shape[axis] + c;
        }
        self.devices.get(flat).copied()
    }

    /// The team of `device` along `pt`: the mesh slice through `device` along `pt`'s axis, in
    /// axis order. `None` when the device is not in the mesh or `pt` maps to no axis.
    pub fn team(&self, device: DeviceId, pt: ParallelType) -> Option<Vec<DeviceId>> {
        let axis = self.axis_of(pt)?;
        let mut coords = self.coords(device)?;
        let mut team = Vec::with_capacity(self.shape[axis]);
        for c in 0..self.shape[axis] {
            coords[axis] = c;
            team.push(self.at(&coords)?);
        }
        Some(team)
    }

    /// The index of `device` inside its team along `pt` (its coordinate on `pt`'s axis).
    pub fn team_index(&self, device: DeviceId, pt: ParallelType) -> Option<usize> {
        let axis = self.axis_of(pt)?;
        Some(self.coords(device)?[axis])
    }

    /// The flattened team of `device` over the parallel types `pts` (a sub-mesh): the devices
    /// whose coordinates differ from `device`'s only on the axes of `pts`, in row-major order of
    /// those axes (outermost mesh axis first, whatever the order of `pts`). `None` when the
    /// device is not in the mesh or some `pt` maps to no axis. One parallel type gives
    /// [`DeviceMesh::team`].
    ///
    /// ```
    /// use meshflow_ir::{DeviceMesh, ParallelType::{DIDx, DIDy, DIDz}};
    /// let m = DeviceMesh::iota(vec![2, 2, 2], 0).unwrap();
    /// assert_eq!(m.flattened_team(5, &[DIDy, DIDx]), Some(vec![4, 5, 6, 7]));
    /// assert_eq!(m.flattened_team(5, &[DIDz, DIDx]), Some(vec![0, 1, 4, 5]));
    /// assert_eq!(m.flattened_index(5, &[DIDz, DIDx]), Some(3));
    /// ```
    pub fn flattened_team(&self, device: DeviceId, pts: &[ParallelType]) -> Option<Vec<DeviceId>> {
        let mut axes = pts
            .iter()
            .map(|&pt| self.axis_of(pt))
            .collect::<Option<Vec<usize>>>()?;
        axes.sort_unstable();
        axes.dedup();
        let mut coords = self.coords(device)?;
        let size: usize = axes.iter().map(|&a| self.shape[a]).product();
        let mut team = Vec::with_capacity(size);
        for flat in 0..size {
            let mut rest = flat;
            for &a in axes.iter().rev() {
                coords[a] = rest % self.shape[a];
                rest /= self.shape[a];
            }
            team.push(self.at(&coords)?);
        }
        Some(team)
    }

    /// The index of `device` in its flattened team over `pts` ([`DeviceMesh::flattened_team`]):
    /// its coordinates on those axes, row-major.
    pub fn flattened_index(&self, device: DeviceId, pts: &[ParallelType]) -> Option<usize> {
        let mut axes = pts
            .iter()
            .map(|&pt| self.axis_of(pt))
            .collect::<Option<Vec<usize>>>()?;
        axes.sort_unstable();
        axes.dedup();
        let coords = self.coords(device)?;
        Some(
            axes.iter()
                .fold(0, |acc, &a| acc * self.shape[a] + coords[a]),
        )
    }

    /// All distinct teams along `pt`, each in axis order, ordered by their first device's
    /// position in the mesh.
    pub fn teams(&self, pt: ParallelType) -> Vec<Vec<DeviceId>> {
        let mut seen: Vec<Vec<DeviceId>> = Vec::new();
        for &d in &self.devices {
            if let Some(team) = self.team(d, pt) {
                if !seen.contains(&team) {
                    seen.push(team);
                }
            }
        }
        seen
    }
}

impl fmt::Display for DeviceMesh {
    /// Prints nested brackets, e.g. `[0, 1, 2, 3]` or `[[0, 1], [2, 3]]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn rec(f: &mut fmt::Formatter<'_>, shape: &[usize], devices: &[DeviceId]) -> fmt::Result {
            f.write_str("[")?;
            if shape.len() == 1 {
                for (i, d) in devices.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{d}")?;
                }
            } else {
                let stride = devices.len() / shape[0];
                for i in 0..shape[0] {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    rec(f, &shape[1..], &devices[i * stride..(i + 1) * stride])?;
                }
            }
            f.write_str("]")
        }
        rec(f, &self.shape, &self.devices)
    }
}
